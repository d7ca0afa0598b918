"""Triton weight-only int8 / int4 matmul for decode-sized batches, registered at quant.py's kernel seam.

[Note: dequantize in the inner loop]
At decode a Linear multiplies a few rows ``x [M, K]`` (M <= 16) by a weight it reads once, so its time is
the weight's bytes: the reference path (dequantize the whole weight to bf16, then ``F.linear``) reads the
codes, writes a bf16 weight and reads it again, slower than the unquantized layer. The kernel here reads
only the codes and scales: each program owns ``BLOCK_N`` output features and walks K one quantization group
(``group_size`` input features, quant.py [Note: weight-only groups]) at a time, ``UNROLL`` groups per loop
iteration so that several loads are in flight (``BLOCK_N``, ``UNROLL`` and the pipeline depth autotuned per
shape). A group's codes are
converted to the input's dtype (integers up to 127 are exact in bf16 and fp16), multiplied by ``x`` with
``tl.dot`` (fp32 accumulation), and the product scaled by the group's per-row scale before it joins the
accumulator: ``sum_g s_g * (x_g . q_g)`` equals ``x . (s * q)`` up to where the rounding happens, so the
kernel agrees with dequantize-then-matmul to within the matmul's rounding, not bit for bit. int4 codes
(two per byte, low nibble first) are split into the even and odd input features and multiplied by the
matching strided halves of ``x``, so nothing is interleaved in registers. The batch is padded to 16 rows
in registers (``tl.dot``'s smallest tile), which costs nothing when reading the weight bounds the time.

[Note: the kernel inside torch.compile]
The launch is a ``torch.library.triton_op`` (``lightning_zero::weight_only_matmul``) calling the kernel
through ``wrap_triton``: torch.compile traces into it as a user-defined Triton kernel, so it runs inside the
compiled decode step (compiled.py) and its CUDA graph without a graph break. Without Triton (the CPU wheel)
nothing here is defined and :func:`triton_weight_only` declines every call, so quant.py's reference runs.
``TRITON_INTERPRET=1`` (read when Triton is imported) runs the kernel on CPU tensors, which is how the
tests check it without a GPU when Triton is installed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_zero.optim.triton_adam import tl, triton, triton_available

MAX_ROWS = 16
"""Largest batch (rows of ``x``) the kernel takes: decode sizes; larger ones (the prompt) take the reference."""
GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes the kernel takes (one ``tl.dot`` per group: a power of two >= 32, so int4's half is >= 16)."""
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_AUTOTUNE = os.environ.get("LIGHTNING_ZERO_TRITON_AUTOTUNE", "1") != "0"
"""``LIGHTNING_ZERO_TRITON_AUTOTUNE=0`` (read at import, like ``TRITON_INTERPRET``): one configuration instead
of twelve per shape and dtype, for tests that check results, not speed (24 shapes x 12 compiles otherwise)."""


if triton is not None:

    @triton.jit
    def _group_product(x_rows, q_rows, s_ptr, rn, n_ok, m_ok, g, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                       GROUPS: tl.constexpr, IEEE: tl.constexpr):
        """``s_g * (x_g . q_g)`` ``[BLOCK_M, BLOCK_N]`` of group ``g`` (zero past the last group)."""
        g_ok = g < GROUPS
        k0 = g * GROUP
        if BITS == 8:
            rk = k0 + tl.arange(0, GROUP)
            x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
            w = tl.load(q_rows + rk[:, None], mask=n_ok[None, :] & g_ok, other=0).to(tl.float32).to(x.dtype)
            if IEEE:
                part = tl.dot(x, w, input_precision="ieee")
            else:
                part = tl.dot(x, w)
        else:
            rh = tl.arange(0, GROUP // 2)
            packed = tl.load(q_rows + (k0 // 2 + rh)[:, None], mask=n_ok[None, :] & g_ok, other=0).to(tl.int32)
            even = k0 + 2 * rh
            low = ((packed & 15) ^ 8) - 8  # two's-complement nibbles: feature 2i low, 2i + 1 high
            high = (((packed >> 4) & 15) ^ 8) - 8
            x_even = tl.load(x_rows + even[None, :], mask=m_ok[:, None] & (even < K)[None, :], other=0.0)
            x_odd = tl.load(x_rows + (even + 1)[None, :], mask=m_ok[:, None] & (even + 1 < K)[None, :], other=0.0)
            if IEEE:
                part = tl.dot(x_even, low.to(tl.float32).to(x_even.dtype), input_precision="ieee")
                part += tl.dot(x_odd, high.to(tl.float32).to(x_odd.dtype), input_precision="ieee")
            else:
                part = tl.dot(x_even, low.to(tl.float32).to(x_even.dtype))
                part += tl.dot(x_odd, high.to(tl.float32).to(x_odd.dtype))
        scale = tl.load(s_ptr + rn.to(tl.int64) * GROUPS + g, mask=n_ok & g_ok, other=0.0)
        return part * scale[None, :]

    @triton.autotune(
        configs=[triton.Config({"BLOCK_N": n, "UNROLL": u}, num_warps=4, num_stages=s)
                 for n in (16, 32, 64) for u in (1, 4) for s in (2, 4)] if _AUTOTUNE and not _INTERPRET
        else [triton.Config({"BLOCK_N": 16, "UNROLL": 2})],
        key=["N", "K", "BITS"],
    )
    @triton.jit
    def _weight_only_kernel(
        x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
        BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        x_rows = x_ptr + rm[:, None] * stride_xm
        q_rows = q_ptr + rn[None, :].to(tl.int64) * row_bytes
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g0 in range(0, GROUPS, UNROLL):  # a constant trip count (K is fixed per layer)
            for j in tl.static_range(UNROLL):  # UNROLL groups' loads in flight per iteration
                acc += _group_product(x_rows, q_rows, s_ptr, rn, n_ok, m_ok, g0 + j, K, BITS, GROUP, GROUPS, IEEE)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @torch.library.triton_op("lightning_zero::weight_only_matmul", mutates_args=())
    def weight_only_matmul(x: Tensor, codes: Tensor, scales: Tensor, bias: Optional[Tensor], out_features: int,
                           bits: int, group_size: int) -> Tensor:
        """``x [M, K] @ dequantized(codes, scales).T + bias`` -> ``[M, out_features]`` in ``x``'s dtype
        ([Note: dequantize in the inner loop]); ``codes``/``scales`` flat, as QuantLinear holds them."""
        m, k = x.shape
        padded = k + (-k) % group_size
        groups = padded // group_size
        y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
        row_bytes = padded // 2 if bits == 4 else padded

        def grid(meta: dict) -> tuple[int, int]:
            return (triton.cdiv(out_features, meta["BLOCK_N"]), triton.cdiv(m, MAX_ROWS))

        torch.library.wrap_triton(_weight_only_kernel)[grid](
            x, codes, scales, bias if bias is not None else scales, y, m, out_features, k, row_bytes,
            x.stride(0), y.stride(0), BITS=bits, GROUP=group_size, GROUPS=groups, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, BLOCK_M=MAX_ROWS)
        return y


def takes(x: Tensor, layer: nn.Module) -> bool:
    """Whether a Triton weight-only kernel (this one, triton_gemv.py's) may compute ``layer(x)``: Triton there,
    CUDA (or the interpreter), the layer's device, a dtype and group size the kernels take, and no backward
    needed (the reference path is differentiable, the kernels are not)."""
    if not triton_available() or (not x.is_cuda and not _INTERPRET) or x.device != layer.codes.device:
        return False
    if x.dtype not in _DTYPES or layer.group_size not in GROUP_SIZES or x.shape[-1] != layer.in_features:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or (layer.bias is not None and layer.bias.requires_grad)))


def triton_weight_only(x: Tensor, layer: nn.Module) -> Optional[Tensor]:
    """The kernel seam's entry (quant.py [Note: the kernel seam]): ``layer(x)`` through the Triton kernel, or
    None (the next kernel or the reference runs) without Triton, off CUDA (unless interpreted), for more
    than :data:`MAX_ROWS` rows, another dtype or a group size the kernel does not take, or where autograd
    would need a backward."""
    if not takes(x, layer):
        return None
    rows = x.numel() // max(layer.in_features, 1)
    if rows == 0 or rows > MAX_ROWS:
        return None
    return call_op(torch.ops.lightning_zero.weight_only_matmul, x, layer, rows)


def call_op(op: Any, x: Tensor, layer: nn.Module, rows: int) -> Tensor:
    """``op(x2, codes, scales, bias, out_features, bits, group_size)`` on ``x`` as ``rows`` contiguous rows
    (the bias in ``x``'s dtype), shaped back to ``x``'s leading dims."""
    x2 = x.reshape(rows, layer.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bias = layer.bias.to(x.dtype) if layer.bias is not None else None
    y = op(x2, layer.codes, layer.scales, bias, layer.out_features, layer.bits, layer.group_size)
    return y.reshape(*x.shape[:-1], layer.out_features)
