"""Over which ranks a flat param group is reduced and partitioned: the data-parallel ranks, or, for
Mixture-of-Experts expert parameters, the ranks holding the same experts.

[Note: expert parameters under ZeRO]
With expert parallelism (parallel_dims.py [Note: expert-parallel groups]) a rank's expert parameters
differ from those of the other ranks of its expert-parallel group, so they cannot share a flat buffer
partitioned over every data-parallel rank. Each optimizer param group is therefore split in two: its
dense parameters, one flat group at the param group's own index (as without experts), and its expert
parameters (``lz_expert``, moe/layer.py), one more flat group appended after all dense ones, reduced,
partitioned and (stage 3) gathered over the expert-data-parallel ranks only. ``engine.comms[gi]`` says
which ranks flat group ``gi`` lives on and ``engine.pg_of[gi]`` which optimizer param group it belongs
to: during the step a param group lists the masters of all its flat groups (an elementwise optimizer
steps both with the same hyper-parameters). Without expert parallelism nothing is split.

[Note: expert gradient scale]
The data-parallel loss is the mean of the ranks' losses, ``L = (1/W) sum_r L_r`` over the ``W``
data-parallel ranks, so every gradient must be ``(1/W) sum_r dL_r``. A dense parameter's gradient on
rank r is ``dL_r``: summed over the W ranks and divided by W. An expert's gradient on the rank holding it
is already a sum over its expert-parallel group (the all-to-all's backward brings back the gradient of
every token routed to it, whichever rank's loss it came from); summing that over the expert-data-parallel
ranks covers every rank once, so it too is divided by W, not by the size of the group it is summed over
(DeepSpeed divides expert gradients by the data-parallel world size for the same reason).
``tests/moe/test_zero_expert_parallel.py`` checks both against a single process.

[Note: gradient norm with experts]
Dense and expert step gradients are summed squared into one scalar that is all-reduced over the
data-parallel ranks. Partitioned (stages 1-3), every element lives on exactly one of them: dense shards
over dp, expert shards over expert-data-parallel ranks, the expert-parallel ranks holding different
experts. Replicated (stage 0), a dense gradient is on all W ranks and an expert gradient on its
``W / ep`` replicas: each group's squares are weighted by 1/replicas before the sum, so every parameter
counts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch.nn import Parameter

from lightning_zero.comm import collectives as C


@dataclass(frozen=True)
class ShardComm:
    """The ranks one flat param group is reduced and partitioned over."""

    group: Optional[C.ProcessGroup]
    """Gradient reductions and (stages 1-2) the all-gather of updated shards."""
    param_group: Optional[C.ProcessGroup]
    """Stage 3's parameter gathers (same ranks: stage3.py [Note: two process groups])."""
    size: int
    rank: int

    @classmethod
    def over(cls, group: Optional[C.ProcessGroup], param_group: Optional[C.ProcessGroup] = None) -> "ShardComm":
        return cls(group, param_group if param_group is not None else group, C.world_size(group), C.rank(group))


def is_expert(param: Parameter) -> bool:
    """moe/layer.py [Note: expert parameters] (read here without importing the MoE package)."""
    return bool(getattr(param, "lz_expert", False))


def place_param_groups(
    per_group: Sequence[list[Parameter]], dense: ShardComm, experts: Optional[ShardComm]
) -> list[tuple[int, ShardComm, list[Parameter]]]:
    """(optimizer param group index, ranks, parameters) of each flat group, in flat-group order: every
    param group's dense parameters first, then the expert parameters of each param group that has
    some (see [Note: expert parameters under ZeRO]). ``experts`` None: nothing is split."""
    if experts is None:
        return [(pi, dense, list(ps)) for pi, ps in enumerate(per_group)]
    out = [(pi, dense, [p for p in ps if not is_expert(p)]) for pi, ps in enumerate(per_group)]
    for pi, ps in enumerate(per_group):
        mine = [p for p in ps if is_expert(p)]
        if mine:
            out.append((pi, experts, mine))
    return out
