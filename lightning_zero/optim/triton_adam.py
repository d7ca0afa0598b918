"""Triton Adam/AdamW kernel: FusedAdam's GPU fallback when the CUDA op cannot be built.

Same contract as the CUDA op (fp32 math, 16-bit gradients in, optional 16-bit
copy out, device-side found-inf flag and step counters, no host sync), one
launch per tensor. ``TRITON_INTERPRET=1`` runs it on CPU tensors, which is how
the tests check it without a GPU when Triton is installed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_BLOCK = 1024


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _adam_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, step_ptr, scale_ptr, inf_ptr, n,
        lr, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2, eps, l2, decay,
        HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        if HAS_INF:
            mask = mask & (tl.load(inf_ptr) == 0.0)
        step = tl.load(step_ptr)  # already counted by the caller
        step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        if l2 != 0.0:  # Adam's L2 term (skipped so an inf param cannot turn 0 * inf into NaN)
            g = g + l2 * p
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        p = p * decay - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offsets, p.to(out_ptr.dtype.element_ty), mask=mask)


def triton_adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    outs: list[Tensor | None],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One Adam/AdamW step, one Triton launch per tensor; steps count unless ``found_inf``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if not params:
        return
    torch._foreach_add_(steps, 1)
    l2 = 0.0 if adamw_mode else weight_decay
    decay = 1.0 - lr * weight_decay if adamw_mode else 1.0
    for p, g, m, v, step, out in zip(params, grads, exp_avgs, exp_avg_sqs, steps, outs):
        n = p.numel()
        if n == 0:
            continue
        _adam_kernel[(triton.cdiv(n, _BLOCK),)](
            p, g, m, v, out if out is not None else p, step,
            grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step, n,
            lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2,
            math.log2(beta1) if beta1 > 0 else -math.inf, math.log2(beta2) if beta2 > 0 else -math.inf,
            eps, l2, decay,
            HAS_OUT=out is not None, HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, BLOCK=_BLOCK,
        )  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(steps, [(found_inf != 0).to(torch.float32).reshape(())] * len(steps))
