"""Pure-torch references of the low-precision host Adam steps (``csrc/cpu_adam/cpu_adam_lowp*``).

They are the oracle of the compiled op and its fallback when the op cannot be built
(``lightning_zero/optim/host_states.py`` picks). Unlike ``reference.py`` they do not run in float64:
they reproduce the op *bit for bit*.

[Note: bitwise reference]
The op and this file compute the same sequence of IEEE fp32 operations, each rounded once:
multiplies and adds as separate tensor ops (never ``addcmul``/``add(alpha=)``, whose kernels may
fuse a multiply-add; the op is compiled with ``-ffp-contract=off`` for the same reason), square
roots in float64 rounded to fp32 (torch's fp32 ``sqrt`` on CPU is not correctly rounded: about 17 %
of random inputs differ from ``sqrtf`` by an ulp; a float64 square root rounded once to fp32 is
correctly rounded, since 53 >= 2 * 24 + 2), divisions
by full tensors (never by a Python scalar, which a kernel may turn into a multiply by the
reciprocal), coefficients rounded to fp32 exactly as ``adam_coeffs.h`` does (computed in double,
then rounded once). Integer work (the hash, the rounding on bit patterns, the 8-bit codes) is exact
by construction; uint32 arithmetic is emulated on int64 with masks, multiplies split in 16-bit
halves so no intermediate leaves int64. So equality is exact, not a tolerance, and the tests say so.

[Note: stochastic rounding bits]
Element ``i`` of a call with ``offset`` draws ``h = mix32(lo ^ (key ^ hi * 0x9E3779B9))`` where
``lo``/``hi`` are the 32-bit halves of the global index ``offset + i`` and
``key = mix32(seed ^ mix32(step ^ 0x9E3779B9))`` (``mix32`` is lowbias32, a full-avalanche 32-bit
hash). Bits 0-15 round the master, bits 16-31 exp_avg, ``mix32(h ^ 0x6A09E667)`` bits 0-15
exp_avg_sq. Counter-based, so the bits depend on nothing but (seed, step, global index): any split
of a buffer into calls, chunks or threads gives the same result, and a resumed run draws the same
bits as an uninterrupted one.

[Note: int8 state codes]
exp_avg is stored as sign + E4M3 (4 exponent bits, 3 mantissa bits, subnormals, no inf/NaN) of
``m / absmax(block)``; exp_avg_sq as unsigned E4M4 of ``sqrt(v) / max(block)``; one fp32 scale per
block each (``absmax`` and ``max`` themselves, so the largest element of a block is exact). Why
these codes: the update divides by ``sqrt(v)``, whose small entries are exactly the ones that must
not collapse to 0 (bitsandbytes' motivation for its dynamic map). A float-like code keeps a
constant *relative* precision over its range: E4M4 of sqrt(v) spans 2^-18..1 (2^-36..1 of v,
10.8 decades) at <= 3.1 % relative error of sqrt(v); E4M3 of m spans 2^-17..1 at <= 6.25 %. A
linear 8-bit code of v would flush everything below max/255 to zero and send ``m / sqrt(v)`` to
``m / eps``. Unlike bitsandbytes' table-based dynamic map, these codes are computed arithmetically
on the fp32 bit pattern (round to nearest even), so encoding needs no table search, vectorises,
and has no ties between table neighbours: op and reference agree on every code. Round-to-nearest
biases an element whose v decays slowly relative to its block's max towards a *larger* v (a decay
of 1 - beta2 per step is below half a code step): the update is then smaller, never larger. The
convergence check (tests/offload/test_host_state_convergence.py) is the evidence that it trains.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_STREAM_V = 0x6A09E667
_MIN_NORMAL = 0x38800000  # 2^-14
_MAGIC = 8388608.0  # 2^23


def f32(x: float) -> float:
    """``x`` rounded once to fp32 (what ``(float)`` of a double does in the op)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# ------------------------------------------------------------------------------------------- hash
def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (per-call keys)."""
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without leaving int64."""
    return ((x * (c & 0xFFFF)) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK


def mix32(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_key(seed: int, step: int) -> int:
    return mix32_int((seed & _MASK) ^ mix32_int((step & _MASK) ^ _GOLDEN))


def sr_bits(key: int, offset: int, n: int, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
    """(h, next) random words of elements offset .. offset+n-1 (see [Note: stochastic rounding bits]), on
    ``device`` (default: the CPU; the device states step there, zero/states16.py)."""
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    h = mix32((idx & _MASK) ^ (key ^ _mul32(idx >> 32, _GOLDEN)))
    return h, mix32(h ^ _STREAM_V)


# ------------------------------------------------------------------------------------ bit helpers
def _bits(x: Tensor) -> Tensor:
    """fp32 -> its bit pattern as a non-negative int64."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK


def _from_bits(u: Tensor) -> Tensor:
    """int64 holding a uint32 bit pattern -> fp32."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def _bf16(u16: Tensor) -> Tensor:
    """int64 holding a uint16 bit pattern -> bf16."""
    return torch.where(u16 >= 2**15, u16 - 2**16, u16).to(torch.int16).view(torch.bfloat16)


def bf16_sr(x: Tensor, r16: Tensor) -> Tensor:
    """fp32 -> bf16, rounded stochastically with the 16 random bits ``r16`` (low bits of an int64)."""
    u = _bits(x)
    r = (u + (r16 & 0xFFFF)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return _bf16(torch.where(nan, torch.full_like(r, 0x7FC0), r))


# ------------------------------------------------------------------------------------ 8-bit codes
def _encode(y: Tensor, mant_bits: int, max_code: int) -> Tensor:
    """Magnitude code of |y| (see [Note: int8 state codes]); int64 in [0, max_code]."""
    a = _bits(y) & 0x7FFFFFFF
    shift = 23 - mant_bits
    normal = ((a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift) - (112 << mant_bits)
    a_sub = torch.where(a < _MIN_NORMAL, a, torch.zeros_like(a))
    z = _from_bits(a_sub) * float(2 ** (14 + mant_bits))
    sub = ((z + _MAGIC) - _MAGIC).to(torch.int64)
    return torch.where(a >= _MIN_NORMAL, normal, sub).clamp_(max=max_code)


def _decode(c: Tensor, mant_bits: int) -> Tensor:
    normal = (c + (112 << mant_bits)) << (23 - mant_bits)
    sub = _bits((c & ((1 << mant_bits) - 1)).to(torch.float32) * (2.0 ** -(14 + mant_bits)))
    return torch.where(c >= (1 << mant_bits), normal, sub)


def encode_m(y: Tensor) -> Tensor:
    """Sign + E4M3 codes (uint8) of fp32 ``y`` (|y| <= ~1)."""
    sign = (_bits(y) >> 24) & 0x80
    return (sign | _encode(y, 3, 0x7F)).to(torch.uint8)


def decode_m(code: Tensor) -> Tensor:
    c = code.to(torch.int64)
    return _from_bits(_decode(c & 0x7F, 3) | ((c & 0x80) << 24))


def encode_w(y: Tensor) -> Tensor:
    """Unsigned E4M4 codes (uint8) of fp32 ``y`` in [0, ~1]."""
    return _encode(y, 4, 0xFF).to(torch.uint8)


def decode_w(code: Tensor) -> Tensor:
    return _from_bits(_decode(code.to(torch.int64), 4))


def block_max(x: Tensor, block: int) -> Tensor:
    """Per-block max of |x| (on bit patterns, as the op: exact, NaN wins); last block may be short."""
    a = _bits(x) & 0x7FFFFFFF
    pad = (-a.numel()) % block
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    return _from_bits(a.view(-1, block).amax(dim=1))


def _safe_inverse(s: Tensor) -> Tensor:
    return torch.where(s > 0, torch.ones_like(s) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))


def quantize_m(m: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """fp32 exp_avg -> (codes, per-block absmax)."""
    scale = block_max(m, block)
    inv = _safe_inverse(scale).repeat_interleave(block)[: m.numel()]
    return encode_m(m * inv), scale


def quantize_w(w: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """fp32 sqrt(exp_avg_sq) -> (codes, per-block max)."""
    scale = block_max(w, block)
    inv = _safe_inverse(scale).repeat_interleave(block)[: w.numel()]
    return encode_w(w * inv), scale


def dequantize(codes: Tensor, scale: Tensor, block: int, signed: bool) -> Tensor:
    value = decode_m(codes) if signed else decode_w(codes)
    return value * scale.repeat_interleave(block)[: codes.numel()]


# ------------------------------------------------------------------------------------ Adam core
class _Coeffs:
    """``lz::AdamCoeffs`` (adam_coeffs.h), each rounded to fp32 the same way."""

    def __init__(self, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 adamw_mode: bool, step: int, grad_scale: float) -> None:
        self.beta1, self.omb1 = f32(beta1), f32(1.0 - beta1)
        self.beta2, self.omb2 = f32(beta2), f32(1.0 - beta2)
        self.eps = f32(eps)
        self.weight_decay = 0.0 if adamw_mode else f32(weight_decay)
        self.decay = f32(1.0 - lr * weight_decay) if adamw_mode else 1.0
        self.step_size = f32(lr / (1.0 - math.pow(beta1, step)))
        self.inv_bc2 = f32(1.0 / math.sqrt(1.0 - math.pow(beta2, step)))  # op: one division fewer per element
        self.inv_grad_scale = f32(1.0 / f32(grad_scale))  # the binding passes grad_scale as a float
        self.lr_wd = f32(lr * weight_decay) if adamw_mode else 0.0


def sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded fp32 square root (``sqrtf``; see [Note: bitwise reference])."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _moments(c: _Coeffs, p: Tensor, grad: Tensor, m0: Tensor, v0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(m, v, sqrt(v)) after the update, each op rounded once in fp32 as in the op."""
    g = grad.to(torch.float32) * c.inv_grad_scale
    if c.weight_decay != 0.0:
        g = g + p * c.weight_decay
    m = m0 * c.beta1 + g * c.omb1
    v = v0 * c.beta2 + (g * c.omb2) * g
    return m, v, sqrt32(v)


def _update(c: _Coeffs, m: Tensor, w: Tensor) -> Tensor:
    """step_size * m / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps): torch's Adam up to one rounding of the
    bias correction (multiplied by its reciprocal, as DeepSpeed's CPU Adam does, which spares the op a
    division per element); the division by a full tensor (see [Note: bitwise reference])."""
    den = w * c.inv_bc2 + c.eps
    return (m / den) * c.step_size


def adam_bf16_reference(
    params: Tensor, comp: Optional[Tensor], grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
    out16: Optional[Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, adamw_mode: bool, grad_scale: float = 1.0, seed: int = 0, offset: int = 0,
) -> None:
    """One step of the bf16 layouts in place: stochastically rounded master (``comp`` None) or Kahan
    master (``comp``: bf16 compensation, both rounded to nearest); moments stochastically rounded."""
    c = _Coeffs(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                step=step, grad_scale=grad_scale)
    p = params.to(torch.float32)
    m, v, w = _moments(c, p, grad, exp_avg.to(torch.float32), exp_avg_sq.to(torch.float32))
    upd = _update(c, m, w)
    h, h2 = sr_bits(sr_key(seed, step), offset, params.numel(), params.device)
    exp_avg.copy_(bf16_sr(m, h >> 16))
    exp_avg_sq.copy_(bf16_sr(v, h2))
    if comp is None:
        params.copy_(bf16_sr(p * c.decay - upd, h))
    else:
        delta = -(upd + p * c.lr_wd)
        y = comp.to(torch.float32) + delta
        pb = (p + y).to(torch.bfloat16)
        comp.copy_((y - (pb.to(torch.float32) - p)).to(torch.bfloat16))
        params.copy_(pb)
    if out16 is not None:
        out16.copy_(params.to(torch.float32).to(out16.dtype))


def adam_int8_reference(
    params: Tensor, grad: Tensor, exp_avg_codes: Tensor, exp_avg_scales: Tensor, exp_avg_sq_codes: Tensor,
    exp_avg_sq_scales: Tensor, out16: Optional[Tensor], *, step: int, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float, adamw_mode: bool, grad_scale: float = 1.0, block: int = 256,
) -> None:
    """One step of the int8 layout in place: fp32 master, blockwise 8-bit moments
    (see [Note: int8 state codes]); dequantise, update, requantise against the new block maxima."""
    c = _Coeffs(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                step=step, grad_scale=grad_scale)
    p = params
    w0 = dequantize(exp_avg_sq_codes, exp_avg_sq_scales, block, signed=False)
    m0 = dequantize(exp_avg_codes, exp_avg_scales, block, signed=True)
    m, _, w = _moments(c, p, grad, m0, w0 * w0)
    pn = p * c.decay - _update(c, m, w)
    params.copy_(pn)
    codes, scale = quantize_m(m, block)
    exp_avg_codes.copy_(codes)
    exp_avg_scales.copy_(scale)
    codes, scale = quantize_w(w, block)
    exp_avg_sq_codes.copy_(codes)
    exp_avg_sq_scales.copy_(scale)
    if out16 is not None:
        out16.copy_(pn.to(out16.dtype))
