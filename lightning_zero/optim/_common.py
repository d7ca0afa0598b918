"""Plumbing shared by the optimizers: per-step extra buffers and torch-compatible state."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def all_params(param_groups: list[dict]) -> list[Tensor]:
    """Parameters in optimizer order: the order ``grads=``/``out16=`` lists follow."""
    return [p for group in param_groups for p in group["params"]]


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, extra_ok: bool = True) -> None:
    """Reject hyper-parameters no Adam-family optimizer can use, at construction (before any step)."""
    if lr < 0 or math.isnan(lr) or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas) or not extra_ok:
        raise ValueError(f"invalid hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")


def adam_defaults(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw_mode: bool) -> dict[str, Any]:
    """Checked param-group defaults in torch.optim.Adam's keys (state dicts move between the two)."""
    check_hyper(lr, betas, eps, weight_decay)
    return dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        amsgrad=False, maximize=False, decoupled_weight_decay=adamw_mode,
    )  # fmt: skip


def align(buffers: Sequence[Tensor | None] | None, params: list[Tensor], what: str) -> list[Tensor | None]:
    """Check a per-parameter list passed to ``step`` and pad 'not given' with None."""
    if buffers is None:
        return [None] * len(params)
    buffers = list(buffers)
    if len(buffers) != len(params):
        raise ValueError(f"{what}: got {len(buffers)} tensors for {len(params)} parameters")
    for buf, p in zip(buffers, params):
        if buf is not None and buf.numel() != p.numel():
            raise ValueError(f"{what}: a tensor of {buf.numel()} elements for a parameter of {p.numel()}")
    return buffers


def adam_state(state: dict, param: Tensor, step_device: torch.device) -> dict:
    """Lazily create torch.optim.Adam's state layout: 'step' (float32 tensor), 'exp_avg', 'exp_avg_sq'.

    A 'step' loaded from a non-fused torch Adam lives on the CPU; it is moved to
    ``step_device`` here so the GPU kernels can read and bump it without a sync.
    """
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
    elif state["step"].device != step_device or state["step"].dtype != torch.float32:
        state["step"] = state["step"].to(device=step_device, dtype=torch.float32)
    return state


def check_group(group: dict, who: str) -> None:
    """Reject torch.optim.Adam options these kernels do not implement (e.g. from a loaded state dict)."""
    for key in ("amsgrad", "maximize"):
        if group.get(key, False):
            raise NotImplementedError(f"{who} does not support {key}=True")


def grad_of(param: Tensor, given: Tensor | None) -> Tensor | None:
    grad = given if given is not None else param.grad
    if grad is not None and grad.is_sparse:
        raise RuntimeError("sparse gradients are not supported")
    return grad
