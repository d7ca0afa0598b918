"""Data-parallel x pipeline-parallel layout of the ranks, and the process groups that go with it.

Ranks are laid out pipeline-major: ``global_rank = pp_rank * dp + dp_rank`` (torchtitan's order).
The data-parallel group of a rank holds the ranks of the same pipeline stage (ZeRO partitions
inside it); the pipeline group holds one rank of every stage with the same ``dp_rank`` (activations
flow inside it). Groups are created here and nowhere else; an instance owns them (no globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_zero.comm import collectives as C


@dataclass
class ParallelDims:
    """Degrees of parallelism and this rank's coordinates; ``build_groups`` creates the groups."""

    world_size: int
    global_rank: int
    pp: int = 1
    dp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    pp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    dp_param_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    """Same ranks as ``dp_group``; ZeRO-3's parameter all-gathers run here (stage3.py's
    [Note: two process groups])."""

    def __post_init__(self) -> None:
        if self.pp < 1 or self.world_size % self.pp != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by pipeline_stages={self.pp}: "
                f"world size must equal data-parallel degree x pipeline stages."
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def dp_rank(self) -> int:
        return self.global_rank % self.dp

    @property
    def pp_rank(self) -> int:
        return self.global_rank // self.dp

    def dp_ranks(self, pp_rank: int) -> list[int]:
        return [pp_rank * self.dp + i for i in range(self.dp)]

    def pp_ranks(self, dp_rank: int) -> list[int]:
        return [s * self.dp + dp_rank for s in range(self.pp)]

    def build_groups(self, timeout_s: Optional[float] = None) -> None:
        """Create the groups (collective: every rank calls it, in the same order)."""
        if not C.is_initialized():
            return
        if self.pp == 1:
            self.dp_group = C.new_group(range(self.world_size), timeout_s)
            self.dp_param_group = C.new_group(range(self.world_size), timeout_s)
            self.pp_group = None
            return
        for s in range(self.pp):
            g = C.new_group(self.dp_ranks(s), timeout_s)
            if s == self.pp_rank:
                self.dp_group = g
        for s in range(self.pp):
            g = C.new_group(self.dp_ranks(s), timeout_s)
            if s == self.pp_rank:
                self.dp_param_group = g
        for d in range(self.dp):
            g = C.new_group(self.pp_ranks(d), timeout_s)
            if d == self.dp_rank:
                self.pp_group = g

    def build_stage_group(self, stages: list[int], timeout_s: Optional[float] = None) -> Optional[C.ProcessGroup]:
        """Groups over the given pipeline stages, one per data-parallel replica (collective: every rank
        calls it, in the same order); this rank's group, or None when its stage is not among ``stages``.
        Tied layers use them (pipeline/tied.py): the copies of one tied module all-reduce their gradients."""
        mine: Optional[C.ProcessGroup] = None
        for d in range(self.dp):
            group = C.new_group([self.pp_ranks(d)[s] for s in stages], timeout_s)
            if d == self.dp_rank and self.pp_rank in stages:
                mine = group
        return mine
