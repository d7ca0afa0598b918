"""Checkpoints of a pipelined run: the stages' pieces combined on global rank 0.

[Note: pipelined checkpoints]
Weights: every stage's state dict is a subset of the un-pipelined one under the same names (see
module.py, [Note: state-dict names]), with full fp32 values already gathered over the stage's
data-parallel group by the strategy. The pipeline of data-parallel rank 0 sends each later stage's
entries that the earlier stages do not have (a tied module is kept once) to its stage 0, which is
global rank 0, the rank Lightning writes from. The result is exactly the state dict of an
un-pipelined run, so ``load_from_checkpoint`` / ``load_state_dict`` on a plain model read it, and a
pipelined run with any stage count loads it (each stage skips other stages' layers).

Optimizer state: each stage's state (torch's per-parameter format over that stage's parameters) is
kept as one entry of ``{"pipeline_stages": P, "stages": [...]}``; resuming needs the same number of
stages (the weights alone load anywhere).

Tensors travel one by one through point-to-point on the pipeline group (CUDA buffers on NCCL), after
the names, shapes and dtypes are broadcast as objects: no rank ever holds a pickled copy of a
stage's weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.parallel_dims import ParallelDims

_TENSOR = "__pipeline_tensor__"


def _skeleton(obj: Any, tensors: list[Tensor]) -> Any:
    """``obj`` with every tensor replaced by a placeholder (collected into ``tensors``)."""
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return (_TENSOR, len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_skeleton(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_skeleton(v, tensors) for v in obj)
    return obj


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _TENSOR


def _placeholders(obj: Any) -> list[tuple]:
    if _is_placeholder(obj):
        return [obj]
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in _placeholders(v)]
    if isinstance(obj, (list, tuple)):
        return [p for v in obj for p in _placeholders(v)]
    return []


def _fill(obj: Any, values: dict[int, Tensor]) -> Any:
    if _is_placeholder(obj):
        return values.get(obj[1])
    if isinstance(obj, dict):
        return {k: _fill(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, values) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, values) for v in obj)
    return obj


def gather_to_first_stage(
    obj: Any, dims: ParallelDims, device: torch.device, skip: Optional[set[str]] = None
) -> Optional[list[Any]]:
    """Every stage's ``obj`` (nested dicts/lists of tensors) on pipeline stage 0 of data-parallel rank 0,
    as CPU tensors; None elsewhere. Collective over the pipeline group. With ``skip`` given, ``obj``
    must be a flat dict and keys already sent by an earlier stage are not sent again (tied modules)."""
    if dims.dp_rank != 0:
        return None
    group = dims.pp_group
    wire = C.device_for(group, device)
    tensors: list[Tensor] = []
    mine = _skeleton(obj, tensors)
    out: list[Any] = [None] * dims.pp
    seen: set[str] = set(skip or ())
    for stage in range(dims.pp):
        skel = C.broadcast_object(mine if stage == dims.pp_rank else None, stage, group)
        wanted = _placeholders(skel)
        if skip is not None:
            assert isinstance(skel, dict)
            keep = {k: v for k, v in skel.items() if k not in seen}
            seen.update(skel)
            wanted = _placeholders(keep)
            skel = keep
        if stage == 0:
            if dims.pp_rank == 0:
                out[0] = _fill(skel, {i: t.detach().cpu() for i, t in enumerate(tensors)})
            continue
        received: dict[int, Tensor] = {}
        for _, index, shape, dtype in wanted:
            if dims.pp_rank == stage:
                C.send(tensors[index].detach().to(wire).contiguous(), 0, group)
            elif dims.pp_rank == 0:
                buf = torch.empty(shape, dtype=dtype, device=wire)
                C.recv(buf, stage, group)
                received[index] = buf.cpu()
        if dims.pp_rank == 0:
            out[stage] = _fill(skel, received)
    return out if dims.pp_rank == 0 else None


def merge_model_state(local: dict[str, Any], dims: ParallelDims, device: torch.device) -> dict[str, Any]:
    """The un-pipelined state dict on global rank 0 (other ranks: their own ``local``)."""
    parts = gather_to_first_stage(local, dims, device, skip=set())
    if parts is None:
        return local
    merged: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


def gather_optimizer_state(local: dict[str, Any], dims: ParallelDims, device: torch.device) -> dict[str, Any]:
    """``{"pipeline_stages": P, "stages": [state of stage 0, ...]}`` on global rank 0."""
    parts = gather_to_first_stage(local, dims, device)
    return {"pipeline_stages": dims.pp, "stages": parts if parts is not None else [local]}


def local_optimizer_state(saved: dict[str, Any], dims: ParallelDims) -> dict[str, Any]:
    """This stage's entry of a state saved by :func:`gather_optimizer_state`."""
    if "stages" not in saved:
        raise ValueError(
            "this checkpoint's optimizer state comes from a run without pipeline stages; a pipelined run can load "
            "its weights (load the state dict, or resume with weights only) but not its optimizer state."
        )
    if saved.get("pipeline_stages") != dims.pp or len(saved["stages"]) != dims.pp:
        raise ValueError(
            f"this checkpoint's optimizer state has {saved.get('pipeline_stages')} pipeline stages and this run has "
            f"{dims.pp}: resume with the same pipeline_stages (the weights alone load with any)."
        )
    return saved["stages"][dims.pp_rank]


__all__ = ["gather_to_first_stage", "merge_model_state", "gather_optimizer_state", "local_optimizer_state"]
