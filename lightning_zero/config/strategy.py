"""Typed configuration of ZeroStrategy: the one place where its defaults are written.

Hydra's ``conf/strategy/*.yaml`` files, the registered strategy names and the
``ZeroStrategy`` constructor all read their defaults from :class:`ZeroConfig`;
nothing else restates them (DeepSpeed writes its defaults in three places, and they drift).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

VALID_STAGES = (0, 1, 2, 3)


@dataclass
class ZeroConfig:
    """What a ZeRO strategy does; every field has a sensible default."""

    stage: int = 2
    """ZeRO stage: 0 data parallel, 1 partitioned optimizer states, 2 also gradients, 3 also parameters."""

    bucket_size_mb: float = 50.0
    """Size cap of one gradient communication bucket, in MiB of 16-bit (or fp32) gradients.
    Larger buckets mean fewer, more efficient collectives; smaller ones start overlapping earlier."""

    overlap_comm: bool = True
    """Run gradient collectives on a side CUDA stream while backward continues (no effect on CPU,
    where gloo collectives are asynchronous already)."""

    unit_policy: Optional[list[str]] = None
    """Stage 3: which module subtrees are gathered as one unit. None: every child of an ``nn.ModuleList``
    (the transformer blocks); else class names or fnmatch patterns of module names, e.g. ``["Block"]``."""

    prefetch_units: int = 1
    """Stage 3: how many units ahead (in the recorded execution order) to all-gather while one computes."""

    max_live_parameters: int = 1_000_000_000
    """Stage 3: prefetching stops while more than this many parameters are gathered at once."""

    param_persistence_threshold: int = 100_000
    """Stage 3: units with at most this many parameters stay gathered (their all-gathers cost more
    latency than their memory is worth)."""

    pipeline_stages: int = 1
    """Pipeline-parallel degree; world size = data-parallel degree x pipeline_stages."""

    process_group_backend: Optional[str] = None
    """torch.distributed backend; None picks nccl on CUDA and gloo on CPU."""

    timeout_s: float = 1800.0
    """Collective timeout of the process groups, in seconds."""

    start_method: str = "popen"
    """How Lightning starts extra local processes: 'popen' re-runs the script (like ddp), 'spawn'/'fork'
    use multiprocessing. Ignored under torchrun/SLURM, which start the processes themselves."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject bad values before any process group exists, naming the valid choices."""
        if self.stage not in VALID_STAGES:
            raise ValueError(f"ZeRO stage must be one of {list(VALID_STAGES)}, got {self.stage!r}.")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb!r}.")
        if self.prefetch_units < 0 or self.max_live_parameters < 1 or self.param_persistence_threshold < 0:
            raise ValueError(
                "prefetch_units >= 0, max_live_parameters >= 1 and param_persistence_threshold >= 0 are required, "
                f"got {self.prefetch_units}, {self.max_live_parameters}, {self.param_persistence_threshold}."
            )
        if self.unit_policy is not None and (
            isinstance(self.unit_policy, str) or not all(isinstance(x, str) for x in self.unit_policy)
        ):
            raise ValueError(f"unit_policy must be a list of class names or module-name patterns, got {self.unit_policy!r}.")
        if not (isinstance(self.pipeline_stages, int) and self.pipeline_stages >= 1):
            raise ValueError(f"pipeline_stages must be an integer >= 1, got {self.pipeline_stages!r}.")
        if self.process_group_backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"process_group_backend must be one of [None, 'nccl', 'gloo'], got {self.process_group_backend!r}."
            )
        if self.start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be one of ['popen', 'spawn', 'fork', 'forkserver'], got {self.start_method!r}."
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ZeroConfig":
        """Build from keyword arguments, failing on unknown names with the list of valid ones
        (DeepSpeed silently drops constructor arguments when a config dict is passed: never here)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown ZeroStrategy option(s) {unknown}; valid options are {sorted(names)}.")
        return cls(**kwargs)


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for ``16-mixed`` (fp16 has too little range for raw gradients)."""

    initial_scale_power: int = 16
    """The first scale is 2**initial_scale_power."""

    growth_interval: int = 1000
    """Double the scale after this many consecutive steps without overflow."""

    hysteresis: int = 2
    """Number of overflows tolerated before the scale is lowered (DeepSpeed's meaning)."""

    min_scale: float = 1.0
    """The scale never drops below this; an overflow at the minimum is still skipped."""

    def __post_init__(self) -> None:
        if self.growth_interval < 1 or self.hysteresis < 1 or self.min_scale <= 0:
            raise ValueError(
                "LossScaleConfig needs growth_interval >= 1, hysteresis >= 1 and min_scale > 0, "
                f"got {self.growth_interval}, {self.hysteresis}, {self.min_scale}."
            )


def config_field_names() -> list[str]:
    """Names accepted by ZeroStrategy(**kwargs) besides its Lightning arguments."""
    return [f.name for f in fields(ZeroConfig)]


__all__ = ["ZeroConfig", "LossScaleConfig", "VALID_STAGES", "config_field_names"]
