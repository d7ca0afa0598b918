"""ZeRO stage 3's own settings: what is gathered as one unit, how far ahead, and what stays gathered.

Read by :class:`lightning_zero.zero.stage3.Stage3Engine`, which takes this piece (``ZeroConfig.piece``)
and restates none of its defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Stage3Config:
    """Stage 3 (parameter partitioning): units, prefetch and persistence."""

    unit_policy: Optional[list[str]] = None
    """Stage 3: which module subtrees are gathered as one unit. None: repeated blocks found through
    ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential`` (transformer blocks, timm/torchvision stages;
    lightning_zero/zero/units.py [Note: what a unit is]); else class names or fnmatch patterns of module
    names, e.g. ``["Block"]``. Parameters read outside their unit's forward are found in the first step
    and kept gathered for whole steps."""

    prefetch_units: int = 1
    """Stage 3: how many units ahead (in the recorded execution order) to all-gather while one computes."""

    max_live_parameters: int = 1_000_000_000
    """Stage 3: prefetching stops while more than this many parameters are gathered at once."""

    param_persistence_threshold: int = 100_000
    """Stage 3: units with at most this many parameters stay gathered (their all-gathers cost more
    latency than their memory is worth)."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.prefetch_units < 0 or self.max_live_parameters < 1 or self.param_persistence_threshold < 0:
            raise ValueError(
                "prefetch_units >= 0, max_live_parameters >= 1 and param_persistence_threshold >= 0 are required, "
                f"got {self.prefetch_units}, {self.max_live_parameters}, {self.param_persistence_threshold}."
            )
        if self.unit_policy is not None and (
            isinstance(self.unit_policy, str) or not all(isinstance(x, str) for x in self.unit_policy)
        ):
            raise ValueError(f"unit_policy must be a list of class names or module-name patterns, got {self.unit_policy!r}.")
