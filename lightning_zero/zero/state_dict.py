"""Sharded engine state <-> the plain, full state dicts Lightning checkpoints hold.

[Note: checkpoints are layout-free]
Checkpoints store what a plain model and ``torch.optim`` would store: fp32 weights by parameter
name, and the optimizer state in torch's per-parameter format. Saving gathers the shards (every
rank takes part; rank 0 writes), loading slices each rank's shard out again. So a checkpoint from
``zero2`` on 4 ranks resumes on 2 ranks or under ``ddp``, and ``load_from_checkpoint`` or a plain
``load_state_dict`` reads it (the peers' sharded directories can do neither without a converter).

[Note: per-parameter step counts in checkpoints]
torch counts ``step`` per parameter; a flat group keeps one count, and the engine remembers how far each
parameter lags it (a parameter that got no gradient on any rank in some step: zero/unused.py). Saving
writes each parameter's own count (the group's minus its lag), loading takes the largest as the group's
count and gives the others their lag back (a parameter with no saved state lags by the whole count, as a
parameter torch never stepped has no state). Without it a resumed run bias-corrected a lagging
parameter's Adam moments with the group's count, unlike ddp's resumed run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.flat_group import FlatParamGroup


_F = TypeVar("_F", bound=Callable[..., Any])


def _in_host_state(fn: _F) -> _F:
    """Run ``fn(engine, ...)`` inside ``engine.host_state()``: NVMe-offloaded masters and optimizer
    states are swapped in for it (and written back after a load)."""

    @functools.wraps(fn)
    def wrapper(engine: ZeroEngine, *args: Any, **kwargs: Any) -> Any:
        with engine.host_state():
            return fn(engine, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _is_sharded(engine: ZeroEngine) -> bool:
    return engine.stage >= 1 and engine.dp_size > 1


def gather_flat(engine: ZeroEngine, fg: FlatParamGroup, shard: Tensor) -> Tensor:
    """The full flat tensor (``layout.total`` elements) of a shard-shaped tensor (collective)."""
    if fg.layout.num_shards == 1:
        return shard
    group = next((c.group for g, c in zip(engine.groups, engine.comms) if g is fg), engine.dp_group)  # experts: shard_comm.py
    full = shard.new_empty(fg.layout.total)
    device = C.device_for(group, engine.device)
    if shard.device != device:  # offloaded host shard under NCCL: through the device, one bucket at a time
        for b in fg.layout.buckets:
            out = torch.empty(b.numel, dtype=shard.dtype, device=device)
            C.all_gather(out, shard[b.shard_offset : b.shard_offset + b.chunk].to(device), group)
            full[b.start : b.end].copy_(out)
        return full
    works = []
    for b in fg.layout.buckets:
        src = shard[b.shard_offset : b.shard_offset + b.chunk].contiguous()
        works.append(C.all_gather(full[b.start : b.end], src, group, async_op=True))
    for w in works:
        w.wait()
    return full


def scatter_flat(fg: FlatParamGroup, per_param: dict[int, Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """This rank's shard of a tensor given per trainable parameter (index in ``fg.params``)."""
    shard_index = fg.shard if fg.layout.num_shards > 1 else 0
    out = torch.zeros(fg.layout.shard_numel, dtype=dtype, device=device)
    for index, start, shard_start, length in fg.layout.param_pieces_in_shard(shard_index):
        src = per_param.get(index)
        if src is not None:
            out[shard_start : shard_start + length].copy_(src.reshape(-1)[start : start + length])
    return out


def _weight_groups(engine: ZeroEngine) -> list:
    """Groups holding weights: the optimizer's, and stage 3's frozen partitions (no optimizer state)."""
    return list(getattr(engine, "all_groups", engine.groups))


def adopt_param_writes(engine: ZeroEngine) -> None:
    """Before the masters are read for a checkpoint or an export: parameter changes made since the last
    step (flat_group.py [Note: writes outside the optimizer]), as the engine's own step takes them
    (16-bit device states too; offload: offload/param_writes.py)."""
    for fg in engine.groups:  # rebind.py [Note: replaced parameter storage]
        fg.rebind_params(engine.param_names, training=False)
    offloaded = getattr(engine, "adopt_param_writes", None)  # the offload engines' (offload/engine.py)
    if offloaded is not None:
        offloaded()
    else:
        for fg in engine.groups:
            fg.adopt_param_writes(engine.states16.compensation(fg) if engine.states16 is not None else None)


@_in_host_state
def full_master_params(engine: ZeroEngine) -> dict[int, Tensor]:
    """Full value of every parameter the engine holds (fp32 masters; stage 3's frozen partitions in
    their compute dtype), keyed by ``id(param)`` (collective). A DTensor parameter's value is its local
    TP shard's (checkpoint/tp_full.py makes it full)."""
    out: dict[int, Tensor] = {}
    adopt_param_writes(engine)
    for fg in _weight_groups(engine):
        full = gather_flat(engine, fg, fg.master)
        for slot in fg.layout.slots:
            p = fg.params[slot.index]
            out[id(p)] = full[slot.offset : slot.offset + slot.numel].view(local_tensor(p).shape).detach().clone()
    return out


@_in_host_state
def load_master_params(engine: ZeroEngine, values: dict[int, Tensor]) -> None:
    """Set the fp32 masters (and the 16-bit parameters) from full values keyed by ``id(param)`` (a
    DTensor parameter's: its local TP shard's)."""
    for fg in _weight_groups(engine):
        per_param = {slot.index: values[id(fg.params[slot.index])] for slot in fg.layout.slots
                     if id(fg.params[slot.index]) in values}
        shard = scatter_flat(fg, per_param, fg.master.dtype, fg.master.device)
        fg.master.copy_(shard)
        if fg.flat_param is not None and not fg.shares_master:  # stages 0-2: parameters are full
            for slot in fg.layout.slots:
                if slot.index in per_param:
                    p = local_tensor(fg.params[slot.index])
                    p.data.copy_(per_param[slot.index].to(p.dtype).view(p.shape))
    after = getattr(engine, "after_master_load", None)
    if callable(after):
        after()


def _torch_ids(engine: ZeroEngine) -> list[dict[int, int]]:
    """torch.optim's state-dict numbering: per group, id(param) -> index (deduplicated, in order)."""
    seen: dict[int, int] = {}
    per_group = []
    nxt = 0
    for params in engine.original_params:
        ids = {}
        for p in params:
            if id(p) not in seen:
                seen[id(p)] = nxt
                nxt += 1
            ids[id(p)] = seen[id(p)]
        per_group.append(ids)
    return per_group


def params_by_index(engine: ZeroEngine) -> dict[int, Tensor]:
    """torch.optim's state-dict numbering: index -> parameter."""
    out: dict[int, Tensor] = {}
    for params, ids in zip(engine.original_params, _torch_ids(engine)):
        for p in params:
            out[ids[id(p)]] = p
    return out


@_in_host_state
def gather_optimizer_state(engine: ZeroEngine) -> dict[str, Any]:
    """The wrapped optimizer's state in torch's per-parameter format (collective)."""
    opt = engine.optimizer
    ids = _torch_ids(engine)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for gi, (fg, pg) in enumerate(zip(engine.groups, opt.param_groups)):
        st = opt.state.get(fg.master, {})
        for key in sorted(st):
            value = st[key]
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == fg.master.numel() and value.numel() > 0:
                full = gather_flat(engine, fg, value)
                for slot in fg.layout.slots:
                    p = fg.params[slot.index]
                    piece = full[slot.offset : slot.offset + slot.numel].view(local_tensor(p).shape).detach().clone()
                    state.setdefault(ids[gi][id(p)], {})[key] = piece
            else:
                lag = engine.used.lag[gi] if key == "step" and engine.used.lagging[gi] else None
                for slot in fg.layout.slots:
                    v = value.detach().clone() if torch.is_tensor(value) else value
                    if lag is not None:  # [Note: per-parameter step counts in checkpoints]
                        v = v - lag[slot.index]
                    state.setdefault(ids[gi][id(fg.params[slot.index])], {})[key] = v
        packed = {k: v for k, v in pg.items() if k != "params"}
        packed["params"] = [ids[gi][id(p)] for p in engine.original_params[gi]]
        groups.append(packed)
    return {"state": state, "param_groups": groups}


@_in_host_state
def load_optimizer_state(engine: ZeroEngine, saved: dict[str, Any]) -> None:
    """Restore state saved by :func:`gather_optimizer_state` (or by a plain torch optimizer)."""
    opt = engine.optimizer
    if len(saved["param_groups"]) != len(opt.param_groups):
        raise ValueError(
            f"Checkpoint has {len(saved['param_groups'])} optimizer param groups, the optimizer has "
            f"{len(opt.param_groups)}."
        )
    ids = _torch_ids(engine)
    saved_state = {int(k): v for k, v in saved["state"].items()}
    opt.state.clear()
    for gi, (fg, pg, spg) in enumerate(zip(engine.groups, opt.param_groups, saved["param_groups"])):
        for k, v in spg.items():
            if k != "params":
                pg[k] = v
        per_key: dict[str, dict[int, Tensor]] = {}
        scalars: dict[str, Any] = {}
        steps: dict[int, float] = {}  # slot index -> its parameter's saved ``step``
        for slot in fg.layout.slots:
            p = fg.params[slot.index]
            entry = saved_state.get(ids[gi][id(p)])
            if not entry:
                continue
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == local_tensor(p).numel():
                    per_key.setdefault(key, {})[slot.index] = value
                else:
                    scalars.setdefault(key, value)
                    if key == "step":
                        steps[slot.index] = float(value)
        count = max(steps.values(), default=0.0)
        engine.used.restore_lags(gi, [int(count - steps.get(i, 0.0)) if steps else 0 for i in range(len(fg.params))])
        if not per_key and not scalars:
            continue
        new_state: dict[str, Any] = {}
        for key, values in per_key.items():
            dtype = next(iter(values.values())).dtype
            new_state[key] = scatter_flat(fg, values, dtype, fg.master.device)
        for key, value in scalars.items():
            if key == "step":  # the group's count: the most-stepped parameter's
                value = torch.full_like(value, count) if torch.is_tensor(value) else type(value)(count)
            new_state[key] = value.clone() if torch.is_tensor(value) else value
        opt.state[fg.master] = new_state
    engine.after_state_load()
