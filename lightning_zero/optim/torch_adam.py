"""Adam through torch's own fused op: the fallback when our compiled op is unavailable.

Handles what our kernels handle (16-bit gradients, a 16-bit copy of the
updated params, a device-side found-inf flag) with extra passes: casts before
and a copy after. If torch's fused op cannot run either, the pure reference
math runs in the params' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.optim.reference import adam_step_reference


def torch_adam_step(
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
    """One Adam/AdamW step over same-device tensors; increments ``steps`` unless ``found_inf``."""
    if not params:
        return
    if found_inf is not None:  # torch's kernels skip only on exactly 1.0; ours on any nonzero
        found_inf = (found_inf != 0).to(torch.float32).reshape(())
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
    grads = [g.reshape(p.shape) for p, g in zip(params, grads)]
    torch._foreach_add_(steps, 1)
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    try:
        fused(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            maximize=False, grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip
    except (RuntimeError, NotImplementedError):  # no fused kernel for this device/dtype: reference math
        skip = found_inf is not None and bool(found_inf.item())
        if not skip:
            scale = 1.0 if grad_scale is None else float(grad_scale.item())
            for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                adam_step_reference(
                    p, g, m, v, step=int(s.item()), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, adamw_mode=adamw_mode, grad_scale=scale,
                )  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))
    for p, out in zip(params, outs):
        if out is not None:
            out.view(p.shape).copy_(p)
