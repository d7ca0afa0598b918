"""Checkpoints under expert parallelism: expert weights and optimizer states stored by global expert
index, so a checkpoint resumes at any expert-parallel size (issue #20, item 3).

[Note: experts in sharded checkpoints]
With ``expert_parallel`` > 1 the ranks of an expert-parallel group hold *different* experts under the
same local names (moe/layer.py [Note: expert parameters]). A sharded checkpoint therefore never sees
local names: :class:`ExpertNames` renames every expert tensor of a rank to the name a single-process
model of all experts gives it (moe/parallel.py [Note: expert state by global index]) before layout.py
derives any key, so ``state_dict.<name>`` and ``optimizer_states.<k>.state.<name>.<key>`` are those of
the EP-1 model, and DCP's resharding does the rest: an EP-2 rank writes its experts' pieces (its ZeRO
partition over the expert-data-parallel ranks, or its even share of them when they are not
partitioned), an EP-1 rank reads every expert, an EP-4 rank only its own.

``meta.pt`` is written by rank 0 alone, which holds only its experts: the other EP ranks' names,
shapes and optimizer-record entries follow from the layer structure, the same on every rank (local
expert ``j`` of EP rank ``r`` is global expert ``r * num_local_experts + j``, of the same shape), so
:meth:`ExpertNames.expand` lists them without a collective, in the single-process model's order (a
layer's experts are consecutive in its state dict: rank 0's run of them, then rank 1's, ...). The
consolidated checkpoint is then the single-process model's state dict and torch's optimizer state
numbered as a single-process optimizer numbers it.

The full format (one state dict gathered by ``full_state_dict`` / torch's per-parameter optimizer
state) is not built under expert parallelism and is refused by :func:`refuse_full_format`.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

from torch import nn

from lightning_zero.moe.layer import MoE

_EXPERT_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?)experts\.(?P<index>\d+)\.(?P<rest>.+)$")


class ExpertNames:
    """One rank's expert state-dict names <-> names by global expert index (see the Note). Built
    from the module the strategy's engines manage; layers with ``ep_size`` 1 are left alone."""

    def __init__(self, module: nn.Module) -> None:
        self.layers: dict[str, MoE] = {
            (name + "." if name else ""): m
            for name, m in module.named_modules()
            if isinstance(m, MoE) and m.ep_size > 1
        }

    @classmethod
    def of(cls, module: Optional[nn.Module]) -> Optional["ExpertNames"]:
        """The renaming of ``module``; None when it holds no expert-parallel layer (nothing renamed)."""
        if module is None:
            return None
        names = cls(module)
        return names if names.layers else None

    def _match(self, name: str) -> Optional[tuple[MoE, str, int, str]]:
        """(layer, prefix, index, rest) when ``name`` is an expert tensor of an expert-parallel layer."""
        m = _EXPERT_NAME.match(name)
        layer = self.layers.get(m.group("prefix")) if m else None
        if layer is None or m is None:
            return None
        return layer, m.group("prefix"), int(m.group("index")), m.group("rest")

    def is_expert(self, name: str) -> bool:
        return self._match(name) is not None

    def stored(self, local_name: str) -> str:
        """A module state-dict name -> the name it is stored under (local expert -> global index)."""
        found = self._match(local_name)
        if found is None:
            return local_name
        layer, prefix, j, rest = found
        return f"{prefix}experts.{layer.global_expert_index(j)}.{rest}"

    def on_rank(self, name: str, ep_rank: int) -> str:
        """A stored name of this rank -> the corresponding stored name of EP rank ``ep_rank`` (the same
        local expert there); other names unchanged."""
        found = self._match(name)
        if found is None:
            return name
        layer, prefix, g, rest = found
        j = g - layer.ep_rank * layer.num_local_experts
        return f"{prefix}experts.{ep_rank * layer.num_local_experts + j}.{rest}"

    def expand(self, names: list[str]) -> Iterator[tuple[str, str, Optional[int]]]:
        """This rank's stored names, in order -> (name on some EP rank, this rank's name it corresponds
        to, that EP rank or None for a name that is no expert's), in the single-process order: each
        run of one layer's expert names is repeated for EP ranks 0, 1, ... (see the Note)."""
        i = 0
        while i < len(names):
            found = self._match(names[i])
            if found is None:
                yield names[i], names[i], None
                i += 1
                continue
            layer = found[0]
            end = i
            while end < len(names) and (f := self._match(names[end])) is not None and f[0] is layer:
                end += 1
            for r in range(layer.ep_size):
                for name in names[i:end]:
                    yield self.on_rank(name, r), name, r
            i = end


def refuse_full_format(expert_parallel: int, what: str) -> None:
    """The full format gathers one state dict over the data-parallel ranks, by local names: under
    expert parallelism it would keep one rank's experts under every name. Not built: refused."""
    if expert_parallel > 1:
        raise NotImplementedError(
            f"{what} with expert_parallel={expert_parallel} is not built yet: use checkpoint_format='sharded' "
            "(the default), which stores experts by global index and resumes at any expert_parallel; "
            "`python -m lightning_zero.checkpoint consolidate DIR` makes one full file of it.")
