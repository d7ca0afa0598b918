"""Pure-torch reference steps: the oracles every compiled optimizer is tested against.

They run in whatever dtype the tensors have, so tests keep float64 copies of the
state and compare the compiled fp32 kernels to them. They are also the last
fallback when neither a compiled op nor torch's fused op can run. Written for
clarity, not speed: one tensor at a time, the math as in the papers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def adam_step_reference(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    grad_scale: float = 1.0,
) -> None:
    """One Adam (L2, ``adamw_mode=False``) or AdamW (decoupled) step in place.

    ``step`` is the 1-based count including this step. ``grad`` is read in any
    float dtype and divided by ``grad_scale`` (loss-scale unscaling).
    """
    g = grad.to(param.dtype) / grad_scale
    if adamw_mode:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay != 0:
        g = g + weight_decay * param
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = exp_avg_sq.sqrt() / math.sqrt(bias_correction2) + eps
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def lamb_step_reference(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_coeff: float,
    min_coeff: float,
    bias_correction: bool,
    grad_scale: float = 1.0,
) -> Tensor:
    """One LAMB step in place (You et al., 2019); returns the tensor's trust ratio.

    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * param, and the step is
    lr * ratio * update with ratio = ||param|| / ||update|| (1 if either norm is
    0), clamped to [min_coeff, max_coeff] as DeepSpeed's FusedLamb does.
    """
    g = grad.to(param.dtype) / grad_scale
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    update = (exp_avg / bias_correction1) / ((exp_avg_sq / bias_correction2).sqrt() + eps)
    if weight_decay != 0:
        update = update + weight_decay * param
    w_norm = param.norm()
    u_norm = update.norm()
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    ratio = ratio.clamp(min_coeff, max_coeff)
    param.sub_(lr * ratio * update)
    return ratio
