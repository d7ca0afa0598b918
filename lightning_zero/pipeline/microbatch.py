"""Cutting a batch into micro-batches, and describing activations so a receiver can allocate them.

An activation crossing stages is a tensor or a tuple of tensors (what layer ``i`` returns and layer
``i + 1`` receives). Its description (:class:`TensorMeta` per tensor) travels as a small int64 tensor
the first time a given message is sent for a given batch shape, and is cached afterwards (see
``runtime.py``, [Note: activation metadata]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

MAX_TENSORS = 8
MAX_DIMS = 8
_FIELDS = 3 + MAX_DIMS  # dtype code, requires_grad, ndim, dims...
META_NUMEL = 2 + MAX_TENSORS * _FIELDS  # is_tuple, count, fields per tensor

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


@dataclass(frozen=True)
class ActivationMeta:
    """Shapes and dtypes of one activation, and whether it is a tuple (else a single tensor)."""

    is_tuple: bool
    tensors: tuple[TensorMeta, ...]

    def empty(self, device: torch.device) -> list[Tensor]:
        return [torch.empty(t.shape, dtype=t.dtype, device=device) for t in self.tensors]


def flatten(activation: Any, where: str) -> tuple[bool, list[Tensor]]:
    """(is_tuple, tensors) of an activation; anything but a tensor or a tuple/list of tensors is an error."""
    if isinstance(activation, Tensor):
        return False, [activation]
    if isinstance(activation, (tuple, list)) and activation and all(isinstance(t, Tensor) for t in activation):
        if len(activation) > MAX_TENSORS:
            raise ValueError(f"{where} returns {len(activation)} tensors; at most {MAX_TENSORS} can cross stages.")
        return True, list(activation)
    raise TypeError(
        f"{where} returns {type(activation).__name__}; what crosses pipeline stages must be a tensor or a "
        "tuple of tensors."
    )


def unflatten(is_tuple: bool, tensors: Sequence[Tensor]) -> Any:
    return tuple(tensors) if is_tuple else tensors[0]


def describe(is_tuple: bool, tensors: Sequence[Tensor]) -> ActivationMeta:
    return ActivationMeta(is_tuple, tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors))


def encode(meta: ActivationMeta, device: torch.device) -> Tensor:
    out = torch.zeros(META_NUMEL, dtype=torch.int64)
    out[0], out[1] = int(meta.is_tuple), len(meta.tensors)
    for i, t in enumerate(meta.tensors):
        if len(t.shape) > MAX_DIMS:
            raise ValueError(f"activations of more than {MAX_DIMS} dimensions cannot cross stages: {t.shape}.")
        if t.dtype not in _DTYPES:
            raise ValueError(f"activation dtype {t.dtype} cannot cross stages; supported: {list(_DTYPES)}.")
        base = 2 + i * _FIELDS
        out[base], out[base + 2] = _DTYPES.index(t.dtype), len(t.shape)
        out[base + 3 : base + 3 + len(t.shape)] = torch.tensor(t.shape, dtype=torch.int64)
    return out.to(device)


def decode(buf: Tensor) -> ActivationMeta:
    vals = buf.tolist()
    tensors = []
    for i in range(int(vals[1])):
        base = 2 + i * _FIELDS
        ndim = int(vals[base + 2])
        tensors.append(TensorMeta(tuple(int(d) for d in vals[base + 3 : base + 3 + ndim]), _DTYPES[int(vals[base])]))
    return ActivationMeta(bool(vals[0]), tuple(tensors))


# ------------------------------------------------------------------------------------------------ batches
def _leaves(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _leaves(o)]
    return []


def batch_size(obj: Any) -> int:
    """Size of dimension 0 shared by every tensor of a batch structure."""
    sizes = {t.shape[0] for t in _leaves(obj) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"a pipelined batch needs tensors that share their first (batch) dimension; got sizes {sorted(sizes)}.")
    return sizes.pop()


def _split(obj: Any, parts: int) -> list[Any]:
    if isinstance(obj, Tensor):
        return list(torch.tensor_split(obj, parts)) if obj.dim() > 0 else [obj] * parts
    if isinstance(obj, (tuple, list)):
        cols = [_split(o, parts) for o in obj]
        return [type(obj)(c[i] for c in cols) if isinstance(obj, tuple) else [c[i] for c in cols] for i in range(parts)]
    if isinstance(obj, dict):
        cols = {k: _split(v, parts) for k, v in obj.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(parts)]
    return [obj] * parts


def split_batch(inputs: Any, labels: Any, microbatches: int, strict: bool) -> tuple[list[Any], list[Any], list[int]]:
    """Cut (inputs, labels) into micro-batches along dimension 0; returns them and their sizes.

    ``strict`` (training): the batch must divide evenly, so that the mean of the micro-batch losses is
    the batch's loss. Otherwise (evaluation) the parts may differ by one sample and are weighted.
    """
    n = batch_size((inputs, labels))
    if strict and n % microbatches != 0:
        raise ValueError(
            f"the per-rank batch size {n} is not divisible by microbatches={microbatches}: choose a batch size "
            "that is a multiple of it (and drop_last=True if the dataset does not divide), or change microbatches."
        )
    m = min(microbatches, n)
    sizes = [n // m + (1 if i < n % m else 0) for i in range(m)]  # torch.tensor_split's sizes
    return _split(inputs, m), _split(labels, m), sizes


def signature(inputs: Any, labels: Any) -> tuple:
    """Shapes and dtypes of a batch: equal on every stage of one pipeline (they load the same batch)."""
    return tuple((tuple(t.shape), t.dtype) for t in _leaves((inputs, labels)))


__all__ = [
    "TensorMeta", "ActivationMeta", "flatten", "unflatten", "describe", "encode", "decode", "split_batch",
    "batch_size", "signature", "META_NUMEL",
]
