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

[Note: stochastic rounding of codes]
Rounding to nearest is biased where it matters for gradients: int4 keeps 15 levels per block, so every
element below half a step (``max|block| / 14``) becomes exactly 0, and Adam, which moves each weight by about
``lr`` whatever its gradient's size, then does not move those weights at all. On 2-4 H200s int4 qgZ ran
4-6% below zero3's gradient norm at every step, always on the same side (benchmarks/RESULTS.md, 2026-11-29
21:22). With a ``seed``, :func:`quantize` rounds stochastically instead: ``floor(x / s + u)``, ``u`` uniform
in ``[0, 1)``, so a code is ``floor`` or ``ceil`` of ``x / s`` with the probabilities that make its
expectation ``x / s`` (unbiased; the error per element is below one step instead of half a step). ``u`` is
not drawn from torch's generator but computed from ``(seed, element index)`` by a 32-bit integer hash
(:func:`uniform_from_hash`): the fused kernel (triton_blocks.py) computes the same bits, so its codes equal
these bit for bit, and a run draws the same values whatever the device or the launch order. The index is
the element's position in the block-padded rows (``row * nb * block + column``).
Measured on 2 H200s (benchmarks/RESULTS.md, 2026-11-29 23:13) it did *not* bring int4 qgZ closer to zero3
(weights 5.98e-2 apart after 4 steps against 5.40e-2 rounding to nearest; the gradient norm still 3-4% low):
what departs is Adam's early, sign-like steps turning any error on small gradients into full-size update
differences, not the rounding's bias. So it is an option (``gradient_rounding``), off by default.
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


_M32 = 0xFFFFFFFF
SEED_LIMIT = 1 << 31
"""Seeds are in ``[0, 2**31)``: a kernel argument Triton types as a signed 32-bit integer."""
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
"""lowbias32's two multipliers (Chris Wellons' hash prospector): ``x ^= x >> 16; x *= a; x ^= x >> 15;
x *= b; x ^= x >> 16``, all modulo 2**32."""


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, with every intermediate below 2**49 (an int64
    product of two 32-bit values may pass 2**63): ``c``'s low and high 16 bits multiplied apart."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * HASH_MULTIPLIERS[0]) & _M32
    x ^= x >> 15
    x = (x * HASH_MULTIPLIERS[1]) & _M32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The 31-bit key a seed's draws xor into every index: the seed hashed first, so that nearby seeds
    (0, 1, 2, ...) do not xor small numbers into the indices, which would hand every element of an aligned
    run the same set of hash inputs over consecutive seeds (draws correlated across steps)."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"a stochastic rounding seed must be in [0, 2**31), got {seed}")
    return _lowbias32(seed) & (SEED_LIMIT - 1)


def uniform_from_hash(seed: int, index: Tensor) -> Tensor:
    """fp32 values in ``[0, 1)`` on a grid of ``2**-24``, one per int64 ``index``, from a 32-bit hash of
    ``(index mod 2**32) ^ seed_key(seed)`` ([Note: stochastic rounding of codes]; the fused kernel's
    ``_uniform``, given the key)."""
    x = (index & _M32) ^ seed_key(seed)
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_MULTIPLIERS[1])
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) * (2.0**-24)


def round_codes(y: Tensor, seed: int | None) -> Tensor:
    """``y`` (fp32 ``x / scale``, any shape, contiguous) rounded in place to integers: half to even, or with a
    ``seed`` stochastically, ``floor(y + u)`` ([Note: stochastic rounding of codes])."""
    if seed is None:
        return y.round_()
    index = torch.arange(y.numel(), device=y.device).view(y.shape)
    return y.add_(uniform_from_hash(seed, index)).floor_()


def quantize(x: Tensor, bits: int = 8, block: int = 2048, seed: int | None = None) -> QuantizedBlocks:
    """``x`` (any float dtype and shape) quantized per block (see [Note: block quantization]), its codes
    rounded stochastically from ``seed`` if given ([Note: stochastic rounding of codes])."""
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
    q = round_codes(blocks / safe[:, None], seed).clamp_(-q_max, q_max).to(torch.int8).view(-1)
    codes = _pack_int4(q) if bits == 4 else q
    return QuantizedBlocks(codes, scales, bits, block, x.shape, x.dtype)


def dequantize(qb: QuantizedBlocks) -> Tensor:
    """The tensor ``qb`` stands for, in its original dtype and shape."""
    q = _unpack_int4(qb.codes) if qb.bits == 4 else qb.codes
    values = (q.view(-1, qb.block) * qb.scales[:, None]).view(-1)  # int8 x fp32: fp32 in one pass
    return values[: qb.shape.numel()].view(qb.shape).to(qb.dtype)
