"""Sign packing with per-chunk scales: the compressor of 1-bit Adam/LAMB.

``pack_signs(x, chunk)`` keeps one bit per element (1 for ``x >= 0``, including
-0.0; 0 for negatives and NaN) and one float32 scale per ``chunk`` elements;
``unpack_signs`` turns them back into ``scale * (+1 | -1)``. ``packed`` is a
flat bit array (bit k of byte j is element 8j+k, pad bits 0), so with ``chunk``
a multiple of 8 every chunk starts on a byte and can be sent on its own (the
all-to-all of compressed momentum). The scale is the chunk's RMS (DeepSpeed's
1-bit Adam: ||x||_2 / sqrt(n)) or its mean |x| (the least-squares optimum for
``scale * sign(x)``).

Each function dispatches to the compiled CPU or CUDA op and falls back to the
pure-torch reference below (same results, scales up to float rounding).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_zero.ops.registry import get_op

ScaleMode = Literal["rms", "mean_abs"]
_MODES: dict[str, int] = {"rms": 0, "mean_abs": 1}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packed_bytes(numel: int) -> int:
    """Bytes of the packed bit array for ``numel`` elements."""
    return (numel + 7) // 8


def num_chunks(numel: int, chunk: int) -> int:
    return (numel + chunk - 1) // chunk


def _check(chunk: int, scale: str) -> None:
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"chunk must be a positive multiple of 8, got {chunk}")
    if scale not in _MODES:
        raise ValueError(f"scale must be one of {sorted(_MODES)}, got {scale!r}")


def pack_signs_reference(x: Tensor, chunk: int, scale: ScaleMode = "rms") -> tuple[Tensor, Tensor]:
    """Pure-torch oracle of ``pack_signs`` (scales computed in float64)."""
    _check(chunk, scale)
    flat = x.reshape(-1)
    n = flat.numel()
    bits = torch.nn.functional.pad((flat >= 0).to(torch.uint8), (0, (-n) % 8))
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.int32, device=flat.device)
    packed = (bits.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)
    values = flat.double().abs() if scale == "mean_abs" else flat.double().square()
    padded = torch.nn.functional.pad(values, (0, (-n) % chunk)).view(-1, chunk)
    lengths = torch.full((padded.shape[0],), float(chunk), dtype=torch.float64, device=flat.device)
    if n % chunk:
        lengths[-1] = n % chunk
    means = padded.sum(dim=1) / lengths
    scales = means if scale == "mean_abs" else means.sqrt()
    return packed, scales.float()


def unpack_signs_reference(
    packed: Tensor, scales: Tensor, numel: int, chunk: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Pure-torch oracle of ``unpack_signs``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()
    per_element = scales.float()[torch.arange(numel, device=packed.device) // chunk]
    return torch.where(bits, per_element, -per_element).to(dtype)


def pack_signs(x: Tensor, chunk: int, scale: ScaleMode = "rms") -> tuple[Tensor, Tensor]:
    """Pack the signs of ``x`` (any shape, read flat) into ``(packed uint8, scales float32)``."""
    _check(chunk, scale)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    op = _op_for(flat)
    if op is None:
        return pack_signs_reference(flat, chunk, scale)
    packed = torch.empty(packed_bytes(n), dtype=torch.uint8, device=flat.device)
    scales = torch.empty(num_chunks(n, chunk), dtype=torch.float32, device=flat.device)
    if flat.is_cuda:
        workspace = torch.empty(op.workspace_floats(n, chunk), dtype=torch.float32, device=flat.device)
        op.pack(flat, chunk, _MODES[scale], packed, scales, workspace, _stream(flat))
    else:
        op.pack(flat, chunk, _MODES[scale], packed, scales, torch.get_num_threads())
    return packed, scales


def unpack_signs(
    packed: Tensor,
    scales: Tensor,
    numel: int,
    chunk: int,
    *,
    dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
) -> Tensor:
    """``scale[chunk of i] * (+1 if bit i else -1)`` for ``numel`` elements, into ``out`` if given."""
    _check(chunk, "rms")
    if out is not None:
        if out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"out must be contiguous with {numel} elements")
        dtype = out.dtype
    target = out if out is not None else torch.empty(numel, dtype=dtype, device=packed.device)
    op = _op_for(target)
    if op is None:
        result = unpack_signs_reference(packed, scales, numel, chunk, dtype)
        if out is None:
            return result
        return out.view(-1).copy_(result).view_as(out)
    flat = target.view(-1)
    if flat.is_cuda:
        op.unpack(packed, scales, chunk, flat, _stream(flat))
    else:
        op.unpack(packed, scales, chunk, flat, torch.get_num_threads())
    return target


def _op_for(t: Tensor):  # -> compiled module | None
    if t.dtype not in _KERNEL_DTYPES:
        return None
    if t.is_cuda:
        return get_op("sign_pack_cuda").try_load()
    if t.device.type == "cpu":
        return get_op("sign_pack_cpu").try_load()
    return None


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream
