"""One fused Triton kernel for the bf16 device states' Adam step (zero/states16.py), bit for bit the reference.

[Note: a fused kernel that equals the reference]
optim/reference_lowp.py's ``adam_bf16_reference`` is some 40 tensor operations on int64 and float64
temporaries: right on any device, but on a GPU it reads and writes about 100 bytes per element where the
step needs 12 to 14 (bf16 master, moments and Kahan word in and out, the fp32 gradient in). This kernel is
the same sequence of operations in one pass, and stays bit for bit equal because every operation is the
one the reference rounds once: fp32 multiplies and adds never contracted into FMAs (launched with
``enable_fp_fusion=False``), divisions and square roots correctly rounded (``div_rn``, ``sqrt_rn``: the
reference's float64 square root rounded once to fp32 is the correctly rounded fp32 one), coefficients
computed on the host exactly as the reference's ``_Coeffs``, the hash on native uint32 (the reference
emulates uint32 on int64), stochastic rounding on the fp32 bit pattern, round-to-nearest-even casts. The
GPU test (tests/states16/test_triton_bf16.py, marked ``gpu``) checks the equality on CUDA;
``TRITON_INTERPRET=1`` runs the kernel on CPU tensors, where the same test runs when Triton is installed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.optim.reference_lowp import _Coeffs, sr_key

from lightning_zero.optim.triton_adam import _BLOCK, tl, triton, triton_available  # one import guard for Triton


if triton is not None:

    @triton.jit
    def _mix32(x):  # lowbias32 on uint32 (reference_lowp.mix32 emulates it on int64)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _widen(bits):
        """bf16 bit patterns (int16) -> fp32, exactly (subnormals included: no conversion unit involved)."""
        return (bits.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _round(x, r):
        """fp32 -> bf16 bit patterns (int16): ``(bits + r) >> 16`` with NaN kept quiet. ``r`` random 16 bits:
        stochastic rounding; ``0x7FFF + lowest kept bit``: round to nearest even (what torch's cast does)."""
        u = x.to(tl.uint32, bitcast=True)
        out = (u + r) >> 16
        out = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, out)
        return out.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _nearest(x):
        u = x.to(tl.uint32, bitcast=True)
        return _round(x, 0x7FFF + ((u >> 16) & 1))

    @triton.jit(do_not_specialize=["n", "offset", "key"])  # a key of 1 must not become a constexpr
    def _bf16_adam_kernel(
        p_ptr, c_ptr, g_ptr, m_ptr, v_ptr, n, offset, key,
        beta1, omb1, beta2, omb2, eps, weight_decay, decay, step_size, inv_bc2, inv_grad_scale, lr_wd,
        KAHAN: tl.constexpr, L2: tl.constexpr, G16: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # beta1 ... lr_wd: the coefficients as the reference rounds them to fp32 (reference_lowp._Coeffs), passed
        # as Python floats, which Triton types fp32 (exact: they are fp32 values)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        p = _widen(tl.load(p_ptr + i, mask=mask, other=0))
        if G16:
            g = _widen(tl.load(g_ptr + i, mask=mask, other=0))
        else:
            g = tl.load(g_ptr + i, mask=mask, other=0.0)
        g = g * inv_grad_scale
        if L2:
            g = g + p * weight_decay
        m = _widen(tl.load(m_ptr + i, mask=mask, other=0)) * beta1 + g * omb1
        v = _widen(tl.load(v_ptr + i, mask=mask, other=0)) * beta2 + (g * omb2) * g
        w = tl.sqrt_rn(v)
        upd = tl.div_rn(m, w * inv_bc2 + eps) * step_size
        idx = offset + i  # [Note: stochastic rounding bits] in reference_lowp.py
        lo = (idx & 0xFFFFFFFF).to(tl.uint32)
        hi = (idx >> 32).to(tl.uint32)
        h = _mix32(lo ^ (key.to(tl.uint32) ^ (hi * 0x9E3779B9)))
        h2 = _mix32(h ^ 0x6A09E667)
        tl.store(m_ptr + i, _round(m, h >> 16), mask=mask)
        tl.store(v_ptr + i, _round(v, h2 & 0xFFFF), mask=mask)
        if KAHAN:
            delta = -(upd + p * lr_wd)
            y = _widen(tl.load(c_ptr + i, mask=mask, other=0)) + delta
            pb = _nearest(p + y)
            tl.store(c_ptr + i, _nearest(y - (_widen(pb) - p)), mask=mask)
            tl.store(p_ptr + i, pb, mask=mask)
        else:
            tl.store(p_ptr + i, _round(p * decay - upd, h & 0xFFFF), mask=mask)


def triton_bf16_adam_step(master: Tensor, comp: Optional[Tensor], grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                          step: int, hyper: AdamHyper, grad_scale: float, seed: int, offset: int) -> None:
    """``bf16_step.bf16_adam_step``'s contract, in one launch (see [Note: a fused kernel that equals the reference])."""
    assert triton is not None, "triton is not installed"
    for t in (master, grad, exp_avg, exp_avg_sq) + (() if comp is None else (comp,)):
        if not t.is_contiguous():
            raise ValueError("triton_bf16_adam_step needs contiguous tensors")
    c = _Coeffs(lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                adamw_mode=hyper.adamw_mode, step=step, grad_scale=grad_scale)
    n = master.numel()
    if n == 0:
        return
    g16 = grad.dtype == torch.bfloat16
    if not g16 and grad.dtype != torch.float32:
        grad = grad.float()
    bits = [t.view(torch.int16) for t in (master, master if comp is None else comp, exp_avg, exp_avg_sq)]
    grid = (triton.cdiv(n, _BLOCK),)
    _bf16_adam_kernel[grid](
        bits[0], bits[1], grad.view(torch.int16) if g16 else grad, bits[2], bits[3], n, offset, sr_key(seed, step),
        c.beta1, c.omb1, c.beta2, c.omb2, c.eps, c.weight_decay, c.decay, c.step_size, c.inv_bc2, c.inv_grad_scale,
        c.lr_wd, KAHAN=comp is not None, L2=c.weight_decay != 0.0, G16=g16, BLOCK=_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip


def use_triton(t: Tensor) -> bool:
    """The fused kernel steps ``t``'s device: a CUDA tensor with Triton installed."""
    return t.is_cuda and triton is not None and torch.cuda.is_available()
