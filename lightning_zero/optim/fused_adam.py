"""FusedAdam: multi-tensor Adam/AdamW on the GPU with the compiled CUDA op.

Few launches for many tensors, fp32 math, optional fused 16-bit copy of the
updated params, and a device-side found-inf flag (GradScaler's) that skips the
step without a host sync. Falls back to a Triton kernel, then to torch's fused
Adam, when the CUDA op cannot be built; CPU tensors take torch's fused Adam.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_zero.ops.registry import get_op
from lightning_zero.optim._bucketed import BucketedOptimizer
from lightning_zero.optim._buckets import Bucket
from lightning_zero.optim._common import adam_defaults, all_params
from lightning_zero.optim.torch_adam import torch_adam_step
from lightning_zero.optim.triton_adam import triton_adam_step, triton_available

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cuda_op_supports(bucket: Bucket) -> bool:
    """fp32 params: fp32/bf16/fp16 grads and a bf16/fp16 copy; 16-bit params: own-dtype grads, no copy."""
    p, g = bucket.params[0].dtype, bucket.grads[0].dtype
    if p == torch.float32:
        return g in _KERNEL_DTYPES and (not bucket.has_out or bucket.outs[0].dtype in (torch.bfloat16, torch.float16))
    return p in (torch.bfloat16, torch.float16) and g == p and not bucket.has_out


class FusedAdam(BucketedOptimizer):
    """Adam/AdamW over CUDA tensors in a few fused launches, as DeepSpeed's ``FusedAdam``.

    Args:
        params: tensors or param groups (fp32 masters, or bf16/fp16 params).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        adamw_mode: True (default) for decoupled weight decay, False for Adam's L2.

    ``step`` accepts per-parameter ``grads`` (e.g. bf16 gradients for fp32
    masters) and ``out16`` (bf16/fp16 buffers receiving the updated params), in
    optimizer order, plus ``grad_scale`` (grads are divided by it) and
    ``found_inf`` (nonzero: skip the step), both device tensors. GradScaler
    passes the last two itself (``_step_supports_amp_scaling``). The state dict
    has torch.optim.Adam's layout, with 'step' on the param's device as torch's
    fused Adam keeps it.
    """

    #: Elementwise math: the ZeRO engine may re-point param groups at flat 1-D shards.
    zero_elementwise: ClassVar[bool] = True
    #: GradScaler hands us grad_scale/found_inf instead of unscaling and syncing.
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
    ) -> None:
        super().__init__(params, adam_defaults(lr, betas, eps, weight_decay, adamw_mode))
        for p in all_params(self.param_groups):
            if not p.is_contiguous() or p.dtype not in _KERNEL_DTYPES:
                raise ValueError(f"FusedAdam needs contiguous float32/bfloat16/float16 params, got {p.dtype}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])

    _display_name: ClassVar[str] = "FusedAdam"

    def _step_bucket(self, b: Bucket, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        hyper = dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], adamw_mode=group["decoupled_weight_decay"],
        )  # fmt: skip
        tensors = (b.params, b.grads, b.exp_avgs, b.exp_avg_sqs)
        if b.device.type == "cuda" and cuda_op_supports(b):
            op = get_op("fused_adam").try_load()
            if op is not None:
                stream = torch.cuda.current_stream(b.device).cuda_stream
                out16 = b.outs if b.has_out else None
                op.adam_step(*tensors, out16, b.steps, grad_scale=grad_scale, found_inf=found_inf, stream=stream, **hyper)
                return
            if triton_available():
                triton_adam_step(*tensors, b.steps, b.outs, grad_scale=grad_scale, found_inf=found_inf, **hyper)
                return
        torch_adam_step(*tensors, b.steps, b.outs, grad_scale=grad_scale, found_inf=found_inf, **hyper)
