"""A Triton GEMV for one-row weight-only int8 / int4 products: the seam's first kernel (decode at batch 1).

[Note: why a second kernel for one row]
triton_wo.py's kernel is a GEMM: it pads the one row to 16 for ``tl.dot`` and walks K one 128-element group at a
time per program, converting every code into the MMA operand layout. A decode row needs a GEMV: here each program
owns ``BLOCK_N`` output features and loads ``[BLOCK_N, GPI x group]`` tiles contiguous along K (the codes' row-major
order, read as 32-bit words so loads coalesce and vectorise), multiplies them by the row of ``x`` in fp32 registers,
sums each group's span, scales it by the group's scale and accumulates: no padding, no MMA, wide tiles and many
programs (``BLOCK_N`` down to 2) so the loads keep HBM busy. Measured per Linear on an H200
(benchmarks/wo_kernels.py, benchmarks/RESULTS.md 2026-11-28 13:14-13:50 UTC), its first version (one I2F conversion
per code) beat triton_wo.py's kernel at every Llama-8B shape at one row (int8 1.26-1.44x bf16's speed against
0.69-1.22x; int4 1.17-1.40x against 0.34-0.76x), so quant.py tries it first.

[Note: no integer conversions]
That first version read int8 at 2.0-2.7 TB/s and int4 at 1.0-1.4 TB/s of the ~4 TB/s the device reads, both at
~2.8e12 codes a second: the conversions were the suspect, not memory. An int-to-float conversion (I2F) issues at a
quarter of the rate of a float multiply-add on sm_80/sm_90 (16 against 64-128 per cycle per SM), and int4 needs one
per code, 8e12 a second at 4 TB/s. So codes are turned into floats with the exponent trick instead: the word is
xor-ed with the sign bit of every code (two's complement to offset binary, once per 4 or 8 codes), each code is
shifted and masked out of the word and or-ed into the mantissa of 2**23 (``0x4B000000``), which as an fp32 is
exactly ``2**23 + u``; subtracting ``2**23 + 2**(bits - 1)`` leaves the signed code, exact. Per code: a shift, one
three-input logic op, a float add and the multiply-add, all at full rate. Code ``j`` of a little-endian word ``w``
is input feature ``codes_per_word x w + j`` (int4: low nibble first), so ``x`` is read as that many strided vectors,
once per program and iteration (cached). Measured per Linear on an H200 (the old and new kernel in one call, 13:22
UTC): int4 0.98 -> 1.37 TB/s (4096 x 14336) and 1.43 -> 1.52 (14336 x 4096); int8 2.3-2.8 TB/s either way. Two
further variants gained nothing measurable and were dropped (13:47 UTC): loading the next tile before the current
one's arithmetic (two tiles in flight), and expanding every code of a tile at once against ``x`` read contiguously.
So what bounds int8 at ~2.8e12 codes a second is neither the conversions nor the bytes in flight alone; the next
suspects are Triton's code for the per-group reduction and the strided ``x`` loads (a profile with Nsight Compute is
the next step, not yet taken). Triton's ahead-of-time compile for sm_90 (benchmarks/wo_kernels_ptx.py) shows 11
``bar.sync`` per K iteration in this kernel: the strided ``x`` vectors pass through shared memory and the group sums
cross warps. A third version without them (``x`` handed over as fp32 in the codes' layout, built by one more op
per Linear, and the groups summed after the loop: no barrier in the loop) measured slower on an H200 (2026-11-28
16:45 UTC, RESULTS.md): int8 13.6 against 9.4 us at 4096 x 4096 and 28.9 against 21.3 us at 14336 x 4096, so
the barriers are not what bounds it either, and this version stays.

Verified against dequantize-then-matmul in Triton's interpreter (CPU) and in the GPU-marked tests.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_zero.inference.triton_wo import _AUTOTUNE, _INTERPRET, call_op, takes
from lightning_zero.optim.triton_adam import tl, triton

if triton is not None:

    @triton.jit
    def _code_value(word, shift: tl.constexpr, MASK: tl.constexpr, OFFSET: tl.constexpr):
        """The signed code at bit ``shift`` of ``word`` (offset-binary after the xor) as an exact fp32 value,
        by the exponent trick of [Note: no integer conversions]: three integer/float ops, no I2F."""
        bits = ((word >> shift) & MASK) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - OFFSET

    @triton.autotune(
        configs=[triton.Config({"BLOCK_N": n, "GPI": g}, num_warps=w)
                 for n in (2, 4, 8) for g in (8, 16) for w in (2, 4)] if _AUTOTUNE and not _INTERPRET
        else [triton.Config({"BLOCK_N": 4, "GPI": 2})],
        key=["N", "K", "BITS"],
    )
    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, N, K, row_words,
                     BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, GPI: tl.constexpr):  # fmt: skip
        PER_WORD: tl.constexpr = 32 // BITS  # codes per 32-bit word: 4 (int8) or 8 (int4)
        WPG: tl.constexpr = GROUP // PER_WORD  # words per group
        WORDS: tl.constexpr = GPI * WPG  # words per row per iteration
        MASK: tl.constexpr = (1 << BITS) - 1
        OFFSET: tl.constexpr = 8388608.0 + (1 << (BITS - 1))  # 2**23 + the offset-binary bias (128 or 8)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        words = q_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None].to(tl.int64) * row_words
        if BITS == 8:  # 0x80808080 / 0x88888888 as int32: the sign bit of every code in a word
            flip = -2139062144
        else:
            flip = -2004318072
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for g0 in range(0, GROUPS, GPI):
            g = g0 + tl.arange(0, GPI)
            rw = g0 * WPG + tl.arange(0, WORDS)
            word = tl.load(words + rw[None, :], mask=n_ok[:, None] & (rw < GROUPS * WPG)[None, :], other=0) ^ flip
            feat = rw * PER_WORD  # input feature of each word's lowest code
            prod = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
            for j in tl.static_range(PER_WORD):  # code j of a word is input feature PER_WORD * w + j
                x = tl.load(x_ptr + feat + j, mask=feat + j < K, other=0.0).to(tl.float32)
                prod += _code_value(word, j * BITS, MASK, OFFSET) * x[None, :]
            part = tl.sum(tl.reshape(prod, (BLOCK_N, GPI, WPG)), axis=2)
            s = tl.load(s_ptr + rn[:, None].to(tl.int64) * GROUPS + g[None, :],
                        mask=n_ok[:, None] & (g < GROUPS)[None, :], other=0.0)
            acc += tl.sum(part * s, axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)

    @torch.library.triton_op("lightning_zero::weight_only_gemv", mutates_args=())
    def weight_only_gemv(x: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor], out_features: int,
                         bits: int, group_size: int) -> Tensor:
        """``x [1, K] @ dequantized(codes, scales).T + bias`` -> ``[1, out_features]`` in ``x``'s dtype."""
        k = x.shape[1]
        padded = k + (-k) % group_size
        y = torch.empty(1, out_features, dtype=x.dtype, device=x.device)

        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(out_features, meta["BLOCK_N"]),)

        torch.library.wrap_triton(_gemv_kernel)[grid](
            x, codes, scales, bias if bias is not None else scales, y, out_features, k,
            (padded // 2 if bits == 4 else padded) // 4, BITS=bits, GROUP=group_size, GROUPS=padded // group_size,
            HAS_BIAS=bias is not None)
        return y


def gemv_takes(x: Tensor, layer: nn.Module) -> bool:
    """Whether :func:`triton_gemv` runs ``layer(x)`` (its docstring says what it declines); traceable by dynamo
    without a graph break, as the compiled decode step needs."""
    if not takes(x, layer) or x.numel() != layer.in_features:
        return False
    return torch.compiler.is_compiling() or layer.codes.storage_offset() % 4 == 0


def triton_gemv(x: Tensor, layer: nn.Module) -> Optional[Tensor]:
    """A kernel for quant.py's seam: ``layer(x)`` for one row through :func:`weight_only_gemv`, else None (the
    same refusals as triton_wo.py's entry: no Triton, off CUDA unless interpreted, another dtype or group size,
    autograd needing a backward; and anything but one row, or codes not starting on a 4-byte boundary, which the
    kernel reads as 32-bit words: a view into a larger buffer, say). The boundary is checked eagerly only: dynamo
    cannot trace ``storage_offset()`` (a graph break, which under ``fullgraph`` fails the compiled decode step),
    and the codes :func:`~lightning_zero.inference.quant.quantize_linears` makes are tensors of their own."""
    if not gemv_takes(x, layer):
        return None
    return call_op(torch.ops.lightning_zero.weight_only_gemv, x, layer, 1)

