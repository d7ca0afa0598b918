"""The full format (one state dict of full tensors) under tensor parallelism.

[Note: full tensors from TP blocks]
ZeRO's gathers (zero/state_dict.py) run over the data-parallel ranks, so under tensor parallelism they
give each rank the full value of its *TP block* of every DTensor parameter (and of its optimizer
state). Saving, the tp ranks then exchange their blocks and each assembles the full tensor, placing
every block where torch's placement arithmetic says it lies (``local_block``; each rank reports its
own, so uneven splits need no arithmetic here). Loading needs no communication: each rank slices its
block out of the full tensor. Replicated DTensors are full on every rank already.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_zero.comm import collectives as C
from lightning_zero.parallel.dtensor import is_tp_sharded, local_block


def _slices(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def block_of(full: Tensor, param: Tensor) -> Tensor:
    """This rank's block of ``full``, the full value of ``param`` (all of it for a plain tensor)."""
    if not is_tp_sharded(param):
        return full
    shape, offset = local_block(param)
    return full[_slices(offset, shape)]


def gather_blocks(pairs: list[tuple[Tensor, Tensor]], group: Optional[C.ProcessGroup]) -> list[Tensor]:
    """Full tensors from every tp rank's blocks: ``pairs`` holds (this rank's block, its DTensor
    parameter), in the same order on every rank (collective over the tp ``group``)."""
    if not pairs:
        return []
    places = C.all_gather_object([(tuple(b.shape), local_block(p)[1]) for b, p in pairs], group)
    out = []
    for i, (block, param) in enumerate(pairs):
        blocks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [rank_places[i] for rank_places in places]  # type: ignore[index]
        n = max(math.prod(shape) for shape, _ in blocks)
        device = C.device_for(group, block.device)  # NCCL gathers device tensors
        send = torch.zeros(n, dtype=block.dtype, device=device)
        send[: block.numel()] = block.reshape(-1)
        recv = send.new_empty(n * len(blocks))
        C.all_gather(recv, send, group)
        recv = recv.to(block.device)
        full = block.new_empty(tuple(param.shape))
        for r, (shape, offset) in enumerate(blocks):
            full[_slices(offset, shape)] = recv[r * n : r * n + math.prod(shape)].view(shape)
        out.append(full)
    return out


def full_weights(out: dict[str, Any], named: Mapping[str, Tensor], group: Optional[C.ProcessGroup]) -> dict[str, Any]:
    """``out`` (state-dict name -> this rank's block) with every TP-sharded entry of ``named`` (the
    module's tensors) made full (collective over tp)."""
    names = [k for k, t in named.items() if is_tp_sharded(t) and torch.is_tensor(out.get(k))]
    for k, full in zip(names, gather_blocks([(out[k], named[k]) for k in names], group)):
        out[k] = full
    return out


def full_optimizer_state(state: dict[str, Any], params: Mapping[int, Tensor], group: Optional[C.ProcessGroup]) -> dict[str, Any]:
    """torch's per-parameter optimizer state whose TP-sharded parameters' tensors (``params``: index ->
    parameter) are their blocks, made full (collective over tp)."""
    keys = [(i, key) for i in sorted(state["state"]) if is_tp_sharded(params.get(i, torch.empty(0)))
            for key in sorted(state["state"][i]) if _is_block(state["state"][i][key], params[i])]
    pairs = [(state["state"][i][key], params[i]) for i, key in keys]
    for (i, key), full in zip(keys, gather_blocks(pairs, group)):
        state["state"][i][key] = full
    return state


def _is_block(value: Any, param: Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == local_block(param)[0]


def local_weights(sd: Mapping[str, Any], named: Mapping[str, Tensor]) -> dict[str, Any]:
    """A full state dict as this rank loads it: each DTensor's entry a DTensor of its block (what
    ``load_state_dict`` copies into a DTensor parameter), everything else as is."""
    out = dict(sd)
    for k, t in named.items():
        if isinstance(t, DTensor) and torch.is_tensor(sd.get(k)) and not isinstance(sd[k], DTensor):
            block = block_of(sd[k], t).to(t.dtype)
            out[k] = DTensor.from_local(block, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                        stride=t.stride())
    return out


def local_optimizer_state(state: dict[str, Any], params: Mapping[int, Tensor]) -> dict[str, Any]:
    """A full optimizer state as this rank loads it: TP-sharded parameters' full tensors sliced to
    their blocks (``params``: torch's state index -> parameter)."""
    per_param = {}
    for i, st in state["state"].items():
        p = params.get(int(i))
        if p is None or not is_tp_sharded(p):
            per_param[i] = st
            continue
        per_param[i] = {key: block_of(v, p) if torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape) else v
                        for key, v in st.items()}
    return {**state, "state": per_param}


__all__ = ["block_of", "full_optimizer_state", "full_weights", "gather_blocks", "local_optimizer_state", "local_weights"]
