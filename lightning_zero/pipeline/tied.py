"""Tied layers across stages: their groups, equal starting weights, summed gradients, one norm term.

A :class:`TiedLayerSpec` key used on several stages (the embedding on the first, the output head on
the last) gives every holding stage a copy of one module. Copies must behave as the single shared
module of an un-pipelined run:

- they start equal: broadcast from the first holder at setup;
- they take the same step: after the last backward of a step their gradients are summed over the
  holders (one all-reduce per key over a group of the holding stages with the same data-parallel
  rank), before the data-parallel reduction, so each copy receives the full gradient;
- the global gradient norm counts them once: the copies on the other holders are subtracted from
  the engine's norm (see :func:`count_tied_once`).

Groups: one per key and data-parallel rank, holding ``ParallelDims.pp_ranks(d)`` of the holding
stages. Every rank creates every group, in the same order, as torch.distributed requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.comm import collectives as C
from lightning_zero.parallel.dtensor import is_tp_sharded, local_tensor
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.pipeline.module import PipelineModule
from lightning_zero.zero.engine import ZeroEngine, squared_norm


@dataclass
class TiedCopy:
    """This rank's copy of one tied module and the group of ranks holding the other copies."""

    key: str
    group: Optional[C.ProcessGroup]
    stages: list[int]
    """Pipeline stages holding the key (group rank i = stages[i])."""
    params: list[Parameter]
    owner: bool
    """The first holder: its copy counts in the gradient norm."""


def build_tied_copies(pipe: PipelineModule, dims: ParallelDims, timeout_s: Optional[float]) -> list[TiedCopy]:
    """Create the tied groups (collective over all ranks, in parallel_dims.py) and return this rank's copies."""
    copies: list[TiedCopy] = []
    holders = pipe.tied_holders()
    for key in sorted(holders):
        stages = holders[key]
        if len(stages) < 2:
            continue
        group = dims.build_stage_group(stages, timeout_s)
        if dims.pp_rank in stages:
            params = list(pipe.tied_module(key).parameters())
            copies.append(TiedCopy(key, group, stages, params, dims.pp_rank == stages[0]))
    return copies


def broadcast_tied_weights(pipe: PipelineModule, copies: Sequence[TiedCopy], device: torch.device) -> None:
    """Make every copy start from the first holder's values (parameters and buffers)."""
    with torch.no_grad():
        for copy in copies:
            module = pipe.tied_module(copy.key)
            for t in list(module.parameters()) + list(module.buffers()):
                t = local_tensor(t)  # a TP-sharded tied module: each tp rank's copies share one TP shard
                buf = t.data.to(C.device_for(copy.group, device))
                C.broadcast(buf, 0, copy.group)
                if buf is not t.data:
                    t.data.copy_(buf)


def _grad_views(engines: Sequence[ZeroEngine]) -> dict[int, Tensor]:
    """id(param) -> the engine buffer its gradient accumulates in (stages 0 and 1 keep full gradients)."""
    views: dict[int, Tensor] = {}
    for engine in engines:
        for fg in engine.groups:
            if fg.flat_grad is None:
                continue
            for si, slot in enumerate(fg.layout.slots):
                views[id(fg.params[slot.index])] = fg.grad_view(si)  # made once (flat_group.py)
    return views


def all_reduce_tied_grads(copies: Sequence[TiedCopy], engines: Sequence[ZeroEngine]) -> None:
    """Sum each tied module's gradients over its holders (one flat all-reduce per key)."""
    views = _grad_views(engines)
    for copy in copies:
        grads = []
        for p in copy.params:
            g = views.get(id(p), p.grad)
            if g is None and p.requires_grad:
                g = p.grad = torch.zeros_like(p)
            if g is not None:
                grads.append(g)
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        C.all_reduce(flat, copy.group, "sum")
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def count_tied_once(engine: ZeroEngine, copies: Sequence[TiedCopy]) -> None:
    """Make ``engine``'s global gradient norm count each tied module once, not once per holder.

    The engine sums squared gradients over its data-parallel shards and over the pipeline stages
    (``norm_groups``); the copies on non-owning holders are the same numbers again, so their squares
    are summed over the same groups and subtracted. Every rank wraps every engine, so the extra
    scalar all-reduces match across ranks. Under tensor parallelism the duplicate squares are weighted
    as the engine weights them (engine.py [Note: gradient norm under tensor parallelism]): a replicated
    copy's by 1/tp, a TP-sharded copy's pieces by 1, then summed over tp as well.
    """
    dup_ids = {id(p) for c in copies if not c.owner for p in c.params}
    tp = engine.tp_size
    pieces: list[tuple[int, int, int, float]] = []  # (group index, start in shard, length, weight)
    for gi, fg in enumerate(engine.groups):
        shard = fg.shard if fg.layout.num_shards > 1 else 0
        for index, _, shard_start, length in fg.layout.param_pieces_in_shard(shard):
            if id(fg.params[index]) in dup_ids:
                weight = 1.0 if tp == 1 or is_tp_sharded(fg.params[index]) else 1.0 / tp
                pieces.append((gi, shard_start, length, weight))
    groups = ([engine.dp_group] if engine.stage >= 1 else []) + list(engine.norm_groups)
    groups += [engine.tp_group] if tp > 1 else []
    original = engine.global_grad_norm_sq

    def global_grad_norm_sq(grads: Sequence[Tensor]) -> Tensor:
        total = original(grads)
        dup = torch.zeros((), dtype=torch.float32, device=engine.device)
        for gi, start, length, weight in pieces:
            dup += weight * squared_norm(grads[gi][start : start + length])
        for group in groups:
            C.all_reduce(dup, group, "sum")
        # on the device: a bool() here would read the norm on the host every step (engine.py [Note: the norm is read lazily])
        return torch.where(torch.isfinite(total), (total - dup).clamp_min(0.0), total)

    engine.global_grad_norm_sq = global_grad_norm_sq  # type: ignore[method-assign]


class EngineGradSync:
    """The runtime's :class:`~lightning_zero.pipeline.runtime.GradSync` over ZeRO stage 0/1 engines.

    During the schedule every engine accumulates locally (``require_sync = False``: stage 0/1 keep
    full gradients). Afterwards, if this backward was meant to sync (not an accumulation step of
    Lightning's ``accumulate_grad_batches``), tied gradients are summed over stages, and the
    strategy's ``post_backward`` (which Lightning calls next) reduces every bucket over the
    data-parallel group, once.
    """

    def __init__(self, engines: Sequence[ZeroEngine], copies: Sequence[TiedCopy]) -> None:
        self.engines = list(engines)
        self.copies = list(copies)
        self._prev: list[bool] = []

    def begin(self) -> None:
        self._prev = [e.require_sync for e in self.engines]
        for e in self.engines:
            e.require_sync = False

    def _restore(self) -> bool:
        for e, prev in zip(self.engines, self._prev):
            e.require_sync = prev
        syncing = all(self._prev)
        self._prev = []
        return syncing

    def finish(self) -> None:
        if self._restore():
            all_reduce_tied_grads(self.copies, self.engines)

    def abort(self) -> None:
        self._restore()


__all__ = [
    "TiedCopy", "build_tied_copies", "broadcast_tied_weights", "all_reduce_tied_grads", "count_tied_once",
    "EngineGradSync",
]
