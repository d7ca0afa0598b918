"""Symmetric block quantization to int8 or int4: the format ZeRO++'s quantized collectives send.

[Note: block quantization]
A tensor is flattened and cut into blocks of ``block`` elements (the last one zero-padded); each block
keeps one fp32 scale ``s = max|x| / q_max`` (``q_max`` 127 for int8, 7 for int4) and its elements as
``round(x / s)`` clamped to ``[-q_max, q_max]`` (round half to even, torch's ``round``). Dequantizing
multiplies back, so every element is within ``s / 2`` of its input, and a block of zeros stays exactly
zero (its scale is 0 and its codes are 0). Symmetric ranges keep zero exact and need no zero point; one
scale per block bounds the error by the block's own magnitude, not the tensor's (DeepSpeed's ZeRO++ uses
blocks of 2048 for weights and gradients). int4 codes are stored two per byte, low nibble first, as
two's-complement nibbles; the wire size per element is then 1 byte (int8) or half a byte (int4), plus
4 bytes per block for the scale: at ``block = 2048``, 0.502x and 0.252x of bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

Q_MAX = {8: 127, 4: 7}
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes whose values fp32 holds exactly (others are converted to fp32 first, as the format defines)."""


@dataclass
class QuantizedBlocks:
    """A quantized tensor: ``codes`` (int8, or uint8 holding two int4 codes each), one fp32 ``scales`` entry
    per block, and what dequantizing needs to rebuild the original."""

    codes: Tensor
    scales: Tensor
    bits: int
    block: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: codes and scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def _pack_int4(q: Tensor) -> Tensor:
    """Two int4 codes per byte, element ``2i`` in the low nibble."""
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8).view(-1, 2)
    return nib[:, 0] | (nib[:, 1] << 4)


def _unpack_int4(packed: Tensor) -> Tensor:
    low = (packed & 0xF).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    both = torch.stack([low, high], dim=1).view(-1)
    return torch.where(both > 7, both - 16, both).to(torch.int8)  # two's-complement nibbles


def quantize(x: Tensor, bits: int = 8, block: int = 2048) -> QuantizedBlocks:
    """``x`` (any float dtype and shape) quantized per block (see [Note: block quantization])."""
    if bits not in Q_MAX:
        raise ValueError(f"bits must be one of {sorted(Q_MAX)}, got {bits}")
    if block < 2 or block % 2:
        raise ValueError(f"block must be an even number >= 2, got {block}")
    flat = x.detach().reshape(-1)
    if flat.dtype not in _EXACT_IN_FP32:
        flat = flat.float()
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block)
    q_max = Q_MAX[bits]
    # [Note: few passes] one reading pass for the scales (the inf-norm: max |x|, NaN-propagating, no |x|
    # temporary), one for the division (a 16-bit input promotes to fp32 in it: the same values as a copy to
    # fp32 first), then rounding and clamping in place: stage 3 quantizes every gathered unit and gradient.
    scales = torch.linalg.vector_norm(blocks, ord=math.inf, dim=1, dtype=torch.float32) / q_max
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (blocks / safe[:, None]).round_().clamp_(-q_max, q_max).to(torch.int8).view(-1)
    codes = _pack_int4(q) if bits == 4 else q
    return QuantizedBlocks(codes, scales, bits, block, x.shape, x.dtype)


def dequantize(qb: QuantizedBlocks) -> Tensor:
    """The tensor ``qb`` stands for, in its original dtype and shape."""
    q = _unpack_int4(qb.codes) if qb.bits == 4 else qb.codes
    values = (q.view(-1, qb.block) * qb.scales[:, None]).view(-1)  # int8 x fp32: fp32 in one pass
    return values[: qb.shape.numel()].view(qb.shape).to(qb.dtype)
