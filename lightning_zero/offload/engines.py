"""The offloading engine of each ZeRO stage, named (no classes built at run time).

``OffloadStageNEngine`` = the stage's offload mixin (flat.py for stages 1-2, sharded.py for stage 3,
both on engine.py's OffloadMixin, which holds the host optimizer and the step policy) in front of the
stage's own engine (lightning_zero/zero/), so the offload code overrides only the engine's marked steps.
"""

from __future__ import annotations

from lightning_zero.offload.flat import FlatOffloadMixin
from lightning_zero.offload.sharded import ParamOffloadMixin
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.stage1 import Stage1Engine
from lightning_zero.zero.stage2 import Stage2Engine
from lightning_zero.zero.stage3 import Stage3Engine


class OffloadStage1Engine(FlatOffloadMixin, Stage1Engine):
    """ZeRO-1 with the optimizer partition (and its step) in host memory or on NVMe."""


class OffloadStage2Engine(FlatOffloadMixin, Stage2Engine):
    """ZeRO-2 with the optimizer partition (and its step) in host memory or on NVMe."""


class OffloadStage3Engine(ParamOffloadMixin, Stage3Engine):
    """ZeRO-3 with the optimizer partition, and optionally the 16-bit partitions, off the device."""


OFFLOAD_ENGINES: dict[int, type[ZeroEngine]] = {1: OffloadStage1Engine, 2: OffloadStage2Engine, 3: OffloadStage3Engine}


def offload_engine(stage: int) -> type[ZeroEngine]:
    """The offloading engine of ZeRO ``stage`` (1-3)."""
    if stage not in OFFLOAD_ENGINES:
        raise ValueError(f"offload needs ZeRO stage >= 1, got stage {stage}")
    return OFFLOAD_ENGINES[stage]
