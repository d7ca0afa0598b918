"""The Adam/AdamW step of the bf16 device states (``state_precision``, zero/states16.py): the arithmetic of
the compact host states' reference (optim/reference_lowp.py ``adam_bf16_reference``) run on the device
tensors themselves, chunk by chunk.

[Note: one step, two places]
The host op (csrc/cpu_adam/cpu_adam_lowp*) and the device states compute the same sequence of fp32
operations with the same counter-based random bits (reference_lowp.py [Note: bitwise reference] and
[Note: stochastic rounding bits]), so a bf16 state steps to the same bits on the CPU, in the host op and
on the device, whatever the chunking, and the reference is the oracle of all three. Here the reference
itself runs on the device tensors, over chunks of ``CHUNK`` elements, so its int64 and float64
temporaries stay bounded (about 10 words per element of a chunk): plain torch, what CI runs on the CPU.
On a CUDA device with Triton installed the step is one fused kernel instead (triton_bf16_adam.py
[Note: a fused kernel that equals the reference]), bit for bit the same; the reference on a GPU is
correct but slow (some 40 elementwise kernels per chunk where the fused kernel makes one pass).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.optim.reference_lowp import adam_bf16_reference
from lightning_zero.optim.triton_bf16_adam import triton_bf16_adam_step, use_triton

CHUNK = 1 << 20
"""Elements per call of the reference on the CPU (temporaries ~80 MB); 4x that on an accelerator."""


def bf16_adam_step(master: Tensor, comp: Optional[Tensor], grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                   step: int, hyper: AdamHyper, grad_scale: float = 1.0, seed: int = 0, offset: int = 0) -> None:
    """One Adam/AdamW update in place of a contiguous bf16 range: ``master`` (bf16; with ``comp``, its
    Kahan compensation, the value is ``master + comp``), ``exp_avg``/``exp_avg_sq`` (bf16); ``grad`` (any
    float dtype) is divided by ``grad_scale``; ``step`` 1-based; element ``i`` draws the random bits of
    global index ``offset + i`` (see [Note: one step, two places])."""
    n = master.numel()
    for t in (grad, exp_avg, exp_avg_sq) + (() if comp is None else (comp,)):
        if t.numel() != n:
            raise ValueError(f"bf16_adam_step: a tensor of {t.numel()} elements for a master of {n}")
    if use_triton(master):  # one fused pass (triton_bf16_adam.py)
        triton_bf16_adam_step(master, comp, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper,
                              grad_scale=grad_scale, seed=seed, offset=offset)
        return
    chunk = CHUNK if master.device.type == "cpu" else 4 * CHUNK
    h = dict(step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
             weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode, grad_scale=grad_scale, seed=seed)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        adam_bf16_reference(master[lo:hi], None if comp is None else comp[lo:hi], grad[lo:hi], exp_avg[lo:hi],
                            exp_avg_sq[lo:hi], None, offset=offset + lo, **h)
