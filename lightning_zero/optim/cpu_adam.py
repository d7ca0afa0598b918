"""CPUAdam: Adam/AdamW over fp32 CPU parameters with the compiled OpenMP/SIMD op.

This is ZeRO-Offload's optimizer: the fp32 masters and both moments live in
host memory and the step is memory-bound, so the op does everything in one
pass: read 16-bit gradients, update params and moments, and write the 16-bit
copy that goes back to the GPU (28 bytes per parameter instead of 40 for a
torch step plus separate casts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_zero.ops.registry import get_op
from lightning_zero.optim._common import adam_defaults, adam_state, align, all_params, check_group, grad_of
from lightning_zero.optim.torch_adam import torch_adam_step

_CPU = torch.device("cpu")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 CPU parameters, as DeepSpeed's ``DeepSpeedCPUAdam``.

    Args:
        params: fp32, contiguous CPU tensors (or param groups of them).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        adamw_mode: True (default) decouples weight decay (AdamW); False adds it
            to the gradient (Adam's L2), as DeepSpeed's CPU Adam does.
        num_threads: OpenMP threads; default ``torch.get_num_threads()``.

    ``step`` also accepts, per parameter in optimizer order, ``grads`` (fp32,
    bf16 or fp16 tensors used instead of ``.grad``, which torch forces to the
    param's dtype) and ``out16`` (bf16/fp16 buffers, e.g. pinned, that receive
    the updated params in the same pass), plus ``grad_scale`` (gradients are
    divided by it). The state dict has torch.optim.Adam's layout ('step',
    'exp_avg', 'exp_avg_sq'; group key 'decoupled_weight_decay'), so
    checkpoints move between this and torch's Adam/AdamW.
    """

    #: The math is elementwise, so the ZeRO engine may re-point param groups at flat 1-D shards.
    zero_elementwise: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        *,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(params, adam_defaults(lr, betas, eps, weight_decay, adamw_mode))
        self.num_threads = num_threads
        for p in all_params(self.param_groups):
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"CPUAdam needs contiguous float32 CPU params, got {p.dtype} on {p.device}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        grads: Sequence[Tensor | None] | None = None,
        out16: Sequence[Tensor | None] | None = None,
        grad_scale: float | None = None,
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = all_params(self.param_groups)
        grads_in, outs = align(grads, params, "grads"), align(out16, params, "out16")
        op = get_op("cpu_adam").try_load()
        threads = self.num_threads or torch.get_num_threads()
        scale = 1.0 if grad_scale is None else float(grad_scale)
        index = 0
        for group in self.param_groups:
            check_group(group, "CPUAdam")
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad, out = grad_of(p, grads_in[index]), outs[index]
                index += 1
                if grad is None:
                    continue
                state = adam_state(self.state[p], p, _CPU)
                hyper = dict(
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=group["decoupled_weight_decay"],
                )  # fmt: skip
                if op is None:
                    scale_t = None if grad_scale is None else torch.tensor(scale)
                    torch_adam_step(
                        [p], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [state["step"]], [out],
                        grad_scale=scale_t, **hyper,
                    )  # fmt: skip
                    continue
                state["step"] += 1
                op.adam_step(
                    p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], out,
                    step=int(state["step"].item()), grad_scale=scale, num_threads=threads, **hyper,
                )  # fmt: skip
        return loss
