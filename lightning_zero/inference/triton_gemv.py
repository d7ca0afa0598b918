"""A Triton GEMV for one-row weight-only int8 / int4 products: the candidate to replace triton_wo.py's kernel at M = 1.

[Note: why a second kernel for one row]
Measured on an H200 (benchmarks/RESULTS.md, 2026-11-28 10:05), triton_wo.py's kernel decodes int8 Llama-8B at
169.5 tokens/s: ~1.4 TB/s of the 4.1 TB/s the device reads, slower than bf16's cuBLAS path. That kernel is a
GEMM: it pads the one row to 16 for ``tl.dot`` and walks K one 128-element group at a time per program, with
the codes loaded K-major (contiguous down the tile's first axis), so each program keeps few bytes in flight and
converts every code into the MMA operand layout. A decode row needs a GEMV: here each program owns
``BLOCK_N`` output features and loads ``[BLOCK_N, GROUPS_PER_ITER x group]`` tiles contiguous along K (the
codes' row-major order, so loads coalesce and vectorise), multiplies them by the row of ``x`` in fp32
registers, sums each group's span, scales it by the group's scale and accumulates: no padding, no MMA, wide
tiles (4-16 KB per iteration) and many programs (``BLOCK_N`` down to 4) so the loads saturate HBM.

Status: verified against dequantize-then-matmul in Triton's interpreter (CPU) and in the GPU-marked tests; not
yet timed, so it is not registered at quant.py's seam by default. ``register_gemv()`` puts it first (what
``benchmarks/inference.py --quant-kernel gemv`` does) so one device call can time it beside the other two.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_zero.inference.triton_wo import _AUTOTUNE, _INTERPRET, call_op, takes
from lightning_zero.optim.triton_adam import tl, triton

if triton is not None:

    @triton.autotune(
        configs=[triton.Config({"BLOCK_N": n, "GPI": g}, num_warps=w)
                 for n in (4, 8, 16) for g in (2, 4) for w in (2, 4)] if _AUTOTUNE and not _INTERPRET
        else [triton.Config({"BLOCK_N": 8, "GPI": 2})],
        key=["N", "K", "BITS"],
    )
    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, N, K, row_bytes,
                     BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, GPI: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        q_rows = q_ptr + rn[:, None].to(tl.int64) * row_bytes
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for g0 in range(0, GROUPS, GPI):
            g = g0 + tl.arange(0, GPI)
            g_ok = g < GROUPS
            if BITS == 8:
                rk = g0 * GROUP + tl.arange(0, GPI * GROUP)
                w = tl.load(q_rows + rk[None, :], mask=n_ok[:, None] & (rk < GROUPS * GROUP)[None, :], other=0)
                x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
                prod = w.to(tl.float32) * x[None, :]
                part = tl.sum(tl.reshape(prod, (BLOCK_N, GPI, GROUP)), axis=2)
            else:  # two codes per byte: feature 2i low nibble, 2i + 1 high, two's complement
                rh = g0 * (GROUP // 2) + tl.arange(0, GPI * (GROUP // 2))
                packed = tl.load(q_rows + rh[None, :], mask=n_ok[:, None] & (rh < GROUPS * (GROUP // 2))[None, :],
                                 other=0).to(tl.int32)
                low = (((packed & 15) ^ 8) - 8).to(tl.float32)
                high = ((((packed >> 4) & 15) ^ 8) - 8).to(tl.float32)
                even = 2 * rh
                x_even = tl.load(x_ptr + even, mask=even < K, other=0.0).to(tl.float32)
                x_odd = tl.load(x_ptr + even + 1, mask=even + 1 < K, other=0.0).to(tl.float32)
                prod = low * x_even[None, :] + high * x_odd[None, :]
                part = tl.sum(tl.reshape(prod, (BLOCK_N, GPI, GROUP // 2)), axis=2)
            s = tl.load(s_ptr + rn[:, None].to(tl.int64) * GROUPS + g[None, :], mask=n_ok[:, None] & g_ok[None, :],
                        other=0.0)
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
            padded // 2 if bits == 4 else padded, BITS=bits, GROUP=group_size, GROUPS=padded // group_size,
            HAS_BIAS=bias is not None)
        return y


def triton_gemv(x: Tensor, layer: nn.Module) -> Optional[Tensor]:
    """A kernel for quant.py's seam: ``layer(x)`` for one row through :func:`weight_only_gemv`, else None (the
    same refusals as triton_wo.py's entry: no Triton, off CUDA unless interpreted, another dtype or group size,
    autograd needing a backward; and anything but one row)."""
    if not takes(x, layer) or x.numel() != layer.in_features:
        return None
    return call_op(torch.ops.lightning_zero.weight_only_gemv, x, layer, 1)


def register_gemv() -> Callable[[], None]:
    """Put :func:`triton_gemv` first at quant.py's seam (before the measured default); returns the undo."""
    from lightning_zero.inference import quant

    quant._KERNELS.insert(0, triton_gemv)
    return lambda: quant._KERNELS.remove(triton_gemv)
