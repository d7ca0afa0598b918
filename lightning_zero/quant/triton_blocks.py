"""Fused Triton kernels for the wire format of ZeRO++'s quantized collectives (comm/quantized.py): quantize
rows into packed bytes, dequantize packed rows straight into the destination, dequantize-and-sum for qgZ.

[Note: fused quantize kernels]
The eager path (quant/blocks.py and comm/quantized.py's ``_quantize_rows``/``_dequantize_rows``) is the
definition and the CPU path; on NVLink it cost more than the bytes it saved (issue #33: qwZ + qgZ at 0.63x
zero3's step time), because each piece made a dozen full passes with temporaries: padding copies, the
scales' norm, a division, rounding, clamping, int8 and int4 packing via int16, the packing copies into the
wire row, then on receive zero-filled codes, unpacking via int16 and ``stack``, an fp32 product and a copy
into the bf16 buffer. Here each is one kernel, one program per (row, block):

* ``quantize_rows``: reads the block once (masked past the row's real elements instead of padding), takes
  ``max |x|``, writes the fp32 scale's four bytes and the codes (int4 nibbles packed in registers) straight
  into the wire row. The row's bytes are not 4-byte aligned (``nb * 4 + code bytes``), hence byte stores.
* ``dequantize_rows_into``: reads a row's scale and codes and writes ``code * scale`` in the destination's
  dtype (bf16 under bf16-mixed) into the gathered buffer: no fp32 temporary, no zero-filled padding.
* ``dequantize_sum``: qgZ's receive side: the ``n`` received rows dequantized and summed in fp32 in one
  pass, rank order, from 0 (as ``sum(0)`` adds them), and divided by the data-parallel size on the way out,
  written (or, accumulating gradients, added) straight into the fp32 gradient shard's chunk
  (comm/quantized.py [Note: qgZ into the gradient shard]).

The arithmetic is the eager definition's, operation for operation, so codes, scales and values equal the
eager reference's bit for bit: the scale is ``max |x| / q_max`` and the code ``rint(x / scale)`` with
correctly rounded divisions (``div_rn``: Triton's ``/`` is an approximate division on CUDA), rounding
half to even (as ``torch.round``), and contraction of a product and a sum into one FMA disabled
(``enable_fp_fusion=False``: eager rounds the product before adding). A block holding a NaN gets a NaN
scale (as ``vector_norm`` propagates it), so a non-finite gradient stays non-finite for the loss scaler's
check; the codes of such a block are not defined (the eager cast of NaN to int8 is not either).
Blocks must be a power of two (``tl.arange``); other sizes take the eager path (``fused_applies``).

[Note: no arranged copy]
hpZ's two-level qgZ sends inner rank ``l`` the chunks ``(j, l)`` of every node ``j``: the bucket viewed as
``[k, h, m]``, transposed to ``[h, k, m]``. The eager path copies the bucket into that order; the quantize
kernel reads it in place instead (``interleave = k``: element ``e`` of row ``l`` is at
``(e // m) * h m + l m + e % m``), which saves a write and a read of the whole bucket per reduction. The
values read are the same, so the bytes are too (a block may straddle two chunks, as in the copy).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lightning_zero.optim.triton_adam import tl, triton, triton_available
from lightning_zero.quant.blocks import seed_key

_MAX_BLOCK = 1 << 16
"""Largest quantization block one program holds in registers; larger blocks take the eager path."""


def fused_applies(t: Tensor, block: int) -> bool:
    """Whether the fused kernels serve ``t``: a CUDA tensor, Triton present, a power-of-two block."""
    return t.is_cuda and triton_available() and block & (block - 1) == 0 and 2 <= block <= _MAX_BLOCK


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4 if block >= 512 else 1


if triton is not None:

    @triton.jit
    def _rint(y):
        """Round half to even (``torch.round``) from ``floor`` and exact comparisons, for ``|y| < 2**22``
        (codes: ``|y| <= q_max`` up to one rounding); plain ops, so Triton's interpreter runs it too."""
        f = tl.floor(y)
        d = y - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)

    @triton.jit
    def _mul32(x, c: tl.constexpr):
        """blocks.py's ``_mul32``: ``x * c mod 2**32`` in int64 with every intermediate below 2**49."""
        lo = x * (c & 0xFFFF)
        hi = ((x * (c >> 16)) & 0xFFFF) << 16
        return (lo + hi) & tl.full((), 0xFFFFFFFF, tl.int64)

    @triton.jit
    def _uniform(index, key):
        """blocks.py's ``uniform_from_hash`` given the seed's key (``seed_key``), the same int64 operations:
        ``[0, 1)`` on a ``2**-24`` grid."""
        x = (index & tl.full((), 0xFFFFFFFF, tl.int64)) ^ key
        x = x ^ (x >> 16)
        x = _mul32(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _mul32(x, 0x846CA68B)
        x = x ^ (x >> 16)
        return (x >> 8).to(tl.float32) * (2.0**-24)

    @triton.jit
    def _round(y, index, key, STOCHASTIC: tl.constexpr):
        """Half to even, or ``floor(y + u)`` (blocks.py ``round_codes``: [Note: stochastic rounding of codes])."""
        if STOCHASTIC:
            return tl.floor(y + _uniform(index, key))
        return _rint(y)

    @triton.jit
    def _source(row, offs, numel, seg, seg_stride, INTERLEAVED: tl.constexpr):
        """Where element ``offs`` of packed row ``row`` is read: ``row * numel + offs``, or, interleaved,
        in segment ``offs // seg`` of that row, ``seg_stride`` elements apart ([Note: no arranged copy])."""
        if INTERLEAVED:
            return row * seg + (offs // seg) * seg_stride + offs % seg
        return row * numel + offs

    @triton.jit(do_not_specialize=["key"])
    def _quantize_kernel(x_ptr, out_ptr, numel, row_bytes, nb, seg, seg_stride, key, Q_MAX: tl.constexpr,
                         BITS: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
                         STOCHASTIC: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        key64 = key.to(tl.int64)
        padded_row = row * nb * BLOCK  # the hash's index: the element's place in the block-padded rows
        out_row = out_ptr + row * row_bytes
        start = b * BLOCK
        if BITS == 8:
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            src = _source(row, offs, numel, seg, seg_stride, INTERLEAVED)
            x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
            absmax = tl.max(tl.abs(x), axis=0)
            nan = tl.max((x != x).to(tl.int32), axis=0)
        else:
            half = tl.arange(0, BLOCK // 2)
            offs = start + 2 * half
            mask = offs < numel
            src_lo = _source(row, offs, numel, seg, seg_stride, INTERLEAVED)
            src_hi = _source(row, offs + 1, numel, seg, seg_stride, INTERLEAVED)
            lo = tl.load(x_ptr + src_lo, mask=mask, other=0.0).to(tl.float32)
            hi = tl.load(x_ptr + src_hi, mask=offs + 1 < numel, other=0.0).to(tl.float32)
            absmax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
            nan = tl.maximum(tl.max((lo != lo).to(tl.int32), axis=0), tl.max((hi != hi).to(tl.int32), axis=0))
        scale = tl.math.div_rn(absmax, tl.full((), Q_MAX, tl.float32))
        scale = tl.where(nan > 0, float("nan"), scale)
        safe = tl.where(scale > 0, scale, 1.0)
        # the scale's four bytes, little-endian (the eager path's ``scales.view(torch.uint8)``)
        k = tl.arange(0, 4)
        sbits = scale.to(tl.int32, bitcast=True)
        tl.store(out_row + b * 4 + k, ((sbits >> (8 * k)) & 0xFF).to(tl.uint8))
        codes = out_row + nb * 4
        if BITS == 8:
            q = _round(tl.math.div_rn(x, safe), padded_row + offs, key64, STOCHASTIC)
            q = tl.minimum(tl.maximum(q, -Q_MAX), Q_MAX)
            q = tl.where(q == q, q, 0.0).to(tl.int32)
            tl.store(codes + offs, (q & 0xFF).to(tl.uint8), mask=mask)
        else:
            ql = _round(tl.math.div_rn(lo, safe), padded_row + offs, key64, STOCHASTIC)
            qh = _round(tl.math.div_rn(hi, safe), padded_row + offs + 1, key64, STOCHASTIC)
            ql = tl.where(ql == ql, tl.minimum(tl.maximum(ql, -Q_MAX), Q_MAX), 0.0).to(tl.int32)
            qh = tl.where(qh == qh, tl.minimum(tl.maximum(qh, -Q_MAX), Q_MAX), 0.0).to(tl.int32)
            byte = (ql & 0xF) | ((qh & 0xF) << 4)
            tl.store(codes + start // 2 + half, byte.to(tl.uint8), mask=mask)

    @triton.jit
    def _load_block(row_ptr, b, numel, nb, BITS: tl.constexpr, BLOCK: tl.constexpr):
        """A block's scale and its codes as fp32 values ``code * scale`` (``lo``/``hi``: even/odd elements
        under int4; under int8 both are the same tensor), with the element offsets and masks."""
        k = tl.arange(0, 4)
        sb = tl.load(row_ptr + b * 4 + k).to(tl.int32)
        scale = tl.sum(sb << (8 * k), axis=0).to(tl.float32, bitcast=True)  # disjoint bytes: sum == or
        start = b * BLOCK
        codes = row_ptr + nb * 4
        if BITS == 8:
            o0 = start + tl.arange(0, BLOCK)
            m0 = o0 < numel
            c = tl.load(codes + o0, mask=m0, other=0).to(tl.int8, bitcast=True)
            v0 = c.to(tl.float32) * scale
            v1, o1, m1 = v0, o0, m0
        else:
            half = tl.arange(0, BLOCK // 2)
            o0 = start + 2 * half
            m0 = o0 < numel
            byte = tl.load(codes + start // 2 + half, mask=m0, other=0).to(tl.int32)
            lo = byte & 0xF
            hi = byte >> 4
            lo = tl.where(lo > 7, lo - 16, lo)  # two's-complement nibbles
            hi = tl.where(hi > 7, hi - 16, hi)
            v0 = lo.to(tl.float32) * scale
            v1 = hi.to(tl.float32) * scale
            o1 = o0 + 1
            m1 = o1 < numel
        return v0, o0, m0, v1, o1, m1

    @triton.jit
    def _dequantize_kernel(packed_ptr, out_ptr, numel, row_bytes, nb, BITS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        v0, o0, m0, v1, o1, m1 = _load_block(packed_ptr + row * row_bytes, b, numel, nb, BITS, BLOCK)
        out_row = out_ptr + row * numel
        tl.store(out_row + o0, v0.to(out_ptr.dtype.element_ty), mask=m0)
        if BITS == 4:
            tl.store(out_row + o1, v1.to(out_ptr.dtype.element_ty), mask=m1)

    @triton.jit
    def _dequantize_sum_kernel(packed_ptr, out_ptr, n, numel, row_bytes, nb, inv, BITS: tl.constexpr,
                               BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = BLOCK if BITS == 8 else BLOCK // 2
        acc0 = tl.zeros((HALF,), tl.float32)
        acc1 = tl.zeros((HALF,), tl.float32)
        start = b * BLOCK
        if BITS == 8:
            o0 = start + tl.arange(0, BLOCK)
        else:
            o0 = start + 2 * tl.arange(0, BLOCK // 2)
        o1 = o0 + 1
        m0 = o0 < numel
        m1 = o1 < numel
        row_ptr = packed_ptr
        for _ in range(0, n):
            v0, _o0, _m0, v1, _o1, _m1 = _load_block(row_ptr, b, numel, nb, BITS, BLOCK)
            acc0 += v0
            acc1 += v1
            row_ptr += row_bytes
        r0 = acc0 * inv
        r1 = acc1 * inv
        if ACCUMULATE:  # gradient accumulation: ``shard + mean``, the product rounded first (no FMA)
            r0 = tl.load(out_ptr + o0, mask=m0, other=0.0) + r0
            if BITS == 4:
                r1 = tl.load(out_ptr + o1, mask=m1, other=0.0) + r1
        tl.store(out_ptr + o0, r0, mask=m0)
        if BITS == 4:
            tl.store(out_ptr + o1, r1, mask=m1)


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def _check(bits: int, block: int) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")
    if bits not in (8, 4) or block & (block - 1) or not 2 <= block <= _MAX_BLOCK:
        raise ValueError(f"fused kernels take bits 8 or 4 and a power-of-two block, got {bits}, {block}")


def quantize_rows(rows: Tensor, bits: int, block: int, out: Optional[Tensor] = None,
                  interleave: int = 1, seed: Optional[int] = None) -> Tensor:
    """comm/quantized.py's ``_quantize_rows`` in one kernel: each row of ``rows`` ([n, numel], any float
    dtype) as one packed wire row (fp32 scales, then the codes of its real elements); flat uint8, written
    into ``out`` if given (contiguous uint8 of that size: qwZ's own slot of the gathered bytes). With
    ``interleave = k``, the rows quantized are those of ``rows.reshape(k, n, numel // k).transpose(0, 1)``
    (read in place: [Note: no arranged copy]). With ``seed``, codes rounded stochastically (blocks.py
    [Note: stochastic rounding of codes])."""
    _check(bits, block)
    rows = rows.detach()
    if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        rows = rows.float()
    rows = rows.contiguous()
    n, numel = rows.shape
    if interleave < 1 or numel % interleave:
        raise ValueError(f"rows of {numel} elements do not hold {interleave} equal segments")
    seg = numel // interleave
    nb = math.ceil(numel / block)
    row_bytes = nb * 4 + _code_bytes(numel, bits)
    if out is None:
        packed = torch.empty(n * row_bytes, dtype=torch.uint8, device=rows.device)
    elif out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != n * row_bytes:
        raise ValueError(f"out must be a contiguous uint8 tensor of {n * row_bytes} elements")
    else:
        packed = out.view(-1)
    if n and numel:
        key = 0 if seed is None else seed_key(seed)
        _quantize_kernel[(n, nb)](rows, packed, numel, row_bytes, nb, seg, n * seg, key, Q_MAX=127 if bits == 8 else 7, BITS=bits, BLOCK=block, INTERLEAVED=interleave > 1,
                                  STOCHASTIC=seed is not None, num_warps=_warps(block),
                                  enable_fp_fusion=False)  # fmt: skip
    return packed


def dequantize_rows_into(out: Tensor, packed: Tensor, n: int, numel: int, bits: int, block: int) -> Tensor:
    """``_dequantize_rows`` written straight into ``out`` (contiguous, ``n * numel`` elements, its own dtype:
    each value rounded once from the fp32 product, as the eager copy into it rounds)."""
    _check(bits, block)
    if not out.is_contiguous() or out.numel() != n * numel:
        raise ValueError("out must be contiguous with n * numel elements")
    nb = math.ceil(numel / block)
    row_bytes = nb * 4 + _code_bytes(numel, bits)
    if n and numel:
        _dequantize_kernel[(n, nb)](packed, out, numel, row_bytes, nb, BITS=bits, BLOCK=block,
                                    num_warps=_warps(block), enable_fp_fusion=False)  # fmt: skip
    return out


def dequantize_sum(packed: Tensor, n: int, numel: int, bits: int, block: int, divisor: int = 1,
                   out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """``_dequantize_rows(...).sum(0).div_(divisor)`` in one kernel: fp32 ``[numel]``, rows added in order
    from 0, then multiplied by the fp32 reciprocal of ``divisor``, as CUDA's ``div_`` by a number does (one
    pass fewer over stage 3's gradient chunks; a multiplication by 1 changes nothing). With ``out`` (fp32,
    contiguous, ``numel`` elements: a chunk of the fp32 gradient shard) the result is written there instead
    of into a new tensor, or with ``accumulate`` added to what ``out`` holds (``out.add_(result)``, bit for
    bit): [Note: qgZ into the gradient shard]."""
    _check(bits, block)
    nb = math.ceil(numel / block)
    row_bytes = nb * 4 + _code_bytes(numel, bits)
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != numel:
        raise ValueError(f"out must be a contiguous fp32 tensor of {numel} elements")
    if numel:
        _dequantize_sum_kernel[(nb,)](packed, out, n, numel, row_bytes, nb, 1.0 / divisor, BITS=bits, BLOCK=block,
                                      ACCUMULATE=accumulate, num_warps=_warps(block),
                                      enable_fp_fusion=False)  # fmt: skip
    return out


__all__ = ["dequantize_rows_into", "dequantize_sum", "fused_applies", "quantize_rows", "triton_available"]
