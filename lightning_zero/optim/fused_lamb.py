"""FusedLamb: multi-tensor LAMB on the GPU with the compiled CUDA op.

LAMB scales each tensor's Adam update by a trust ratio ||param|| / ||update||,
so its math is not elementwise: the ZeRO engine must keep whole tensors
(``zero_elementwise = False``). Falls back to the reference math in fp32 with
torch ops (one tensor at a time; a found-inf flag then costs a host sync) when
the CUDA op cannot be built, and on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_zero.ops.registry import get_op
from lightning_zero.optim._bucketed import BucketedOptimizer
from lightning_zero.optim._buckets import Bucket
from lightning_zero.optim._common import all_params, check_hyper
from lightning_zero.optim.fused_adam import cuda_op_supports
from lightning_zero.optim.reference import lamb_step_reference


class FusedLamb(BucketedOptimizer):
    """LAMB (You et al., 2019) over CUDA tensors in a few fused launches, as DeepSpeed's ``FusedLamb``.

    Args:
        params: tensors or param groups (fp32 masters, or bf16/fp16 params).
        lr, betas, eps: as Adam.
        weight_decay: added to the Adam update before the trust ratio.
        bias_correction: Adam's bias correction of the moments.
        max_coeff, min_coeff: the trust ratio is clamped to [min_coeff, max_coeff].

    ``step`` takes ``grads``, ``out16``, ``grad_scale`` and ``found_inf`` as
    ``FusedAdam.step`` does; GradScaler passes the last two itself. The state
    has torch.optim.Adam's layout ('step', 'exp_avg', 'exp_avg_sq').
    """

    #: Per-tensor trust ratios: param groups must hold whole tensors, not flat shards.
    zero_elementwise: ClassVar[bool] = False
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay, extra_ok=min_coeff <= max_coeff)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            max_coeff=max_coeff, min_coeff=min_coeff,
        )  # fmt: skip
        super().__init__(params, defaults)
        for p in all_params(self.param_groups):
            if not p.is_contiguous() or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"FusedLamb needs contiguous float32/bfloat16/float16 params, got {p.dtype}")

    _display_name: ClassVar[str] = "FusedLamb"

    def _step_bucket(self, b: Bucket, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        hyper = dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            max_coeff=group["max_coeff"], min_coeff=group["min_coeff"], bias_correction=group["bias_correction"],
        )  # fmt: skip
        if b.device.type == "cuda" and cuda_op_supports(b):
            op = get_op("fused_lamb").try_load()
            if op is not None:
                workspace = torch.empty(
                    op.workspace_floats([p.numel() for p in b.params]), dtype=torch.float32, device=b.device
                )
                op.lamb_step(
                    b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.outs if b.has_out else None, b.steps,
                    workspace, None, grad_scale=grad_scale, found_inf=found_inf,
                    stream=torch.cuda.current_stream(b.device).cuda_stream, **hyper,
                )  # fmt: skip
                return
        _torch_lamb_step(b, hyper, grad_scale, found_inf)


def _torch_lamb_step(b: Bucket, hyper: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
    """Fallback: the reference math in fp32 per tensor (syncs once on found_inf/grad_scale)."""
    if found_inf is not None and bool(found_inf.item()):
        return
    scale = 1.0 if grad_scale is None else float(grad_scale.item())
    for p, g, m, v, step, out in zip(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps, b.outs):
        step += 1
        p32, m32, v32 = p.float(), m.float(), v.float()
        lamb_step_reference(p32, g.reshape(p.shape), m32, v32, step=int(step.item()), grad_scale=scale, **hyper)
        for dst, src in ((p, p32), (m, m32), (v, v32)):
            if dst is not src:
                dst.copy_(src)
        if out is not None:
            out.view(p.shape).copy_(p)
