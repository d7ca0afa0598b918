"""OneBitAdam: Adam whose momentum, after a warm-up, is averaged with a 1-bit error-compensated all-reduce.

1-bit Adam (Tang et al., 2021; DeepSpeed's ``OnebitAdam``): Adam's variance stabilises early in
training, so after ``freeze_step`` exact steps it is frozen and Adam becomes a momentum SGD with a
fixed per-element preconditioner. Momentum SGD tolerates error-compensated compression, so the
ranks stop all-reducing gradients and average their momentum through signs plus scales (about
1/16 of a 16-bit all-reduce's bytes, see lightning_zero/comm/compressed/).

Use it with ``ZeroStrategy(stage=0)`` (``strategy="zero0"``): the strategy hands it the backend and
switches the gradient all-reduce off in the compression phase (see [Note: two phases] in
``_onebit.py``). Alone, on one process, it is Adam with a frozen variance after ``freeze_step``.

Differences from DeepSpeed's ``OnebitAdam``, on purpose: bias correction is applied
(``bias_correction=True``, as torch.optim.Adam; the frozen variance keeps the correction of the
step it was frozen at), so the warm-up *is* torch's Adam/AdamW; scales are per block of 1024
elements, not one per rank's chunk; the error buffers survive checkpoints.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from torch import Tensor

from lightning_zero.comm.compressed.backend import CompressedBackend
from lightning_zero.optim._common import check_hyper
from lightning_zero.optim._onebit import OneBitOptimizer, bias_corrections


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam / AdamW.

    Args:
        params: tensors or param groups.
        lr, betas, eps: as torch.optim.Adam.
        freeze_step: exact Adam steps (with full-precision gradient averaging) before compression;
            DeepSpeed's guidance is 15-25% of training.
        weight_decay: decoupled (AdamW, as DeepSpeed's 1-bit Adam) unless ``adamw_mode=False``,
            which adds it to the gradient (Adam's L2; it then goes through the compressed momentum).
        bias_correction: Adam's bias correction of the moments.
        comm_backend: the compressed-communication backend; ZeroStrategy sets it.
        checkpoint_errors: save every rank's error buffers in checkpoints (rank 0 gathers them);
            False resets them on resume, as DeepSpeed does.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100_000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        comm_backend: Optional[CompressedBackend] = None,
        checkpoint_errors: bool = True,
    ) -> None:
        betas = (float(betas[0]), float(betas[1]))
        check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )  # fmt: skip
        super().__init__(
            params, defaults, freeze_step=freeze_step, comm_backend=comm_backend, checkpoint_errors=checkpoint_errors
        )

    def _adam_step(self, group: dict[str, Any], p: Tensor, m: Tensor, v: Tensor, step: int) -> None:
        """The parameter update from the moments; the variance's bias correction stops at freeze_step."""
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        if wd and group["adamw_mode"]:
            p.mul_(1 - lr * wd)
        bc1, bc2 = bias_corrections(beta1, beta2, step, min(step, self.freeze_step), group["bias_correction"])
        denom = (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
        p.addcdiv_(m, denom, value=-lr / bc1)

    def _local_grad(self, group: dict[str, Any], p: Tensor, grad: Tensor) -> Tensor:
        wd = group["weight_decay"]
        return grad.add(p, alpha=wd) if wd and not group["adamw_mode"] else grad

    def _warmup_update(self, index: int, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        g = self._local_grad(group, p, grad)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        self._adam_step(group, p, m, v, int(state["step"]))

    def _compressed_update(self, index: int, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict) -> None:
        beta1 = group["betas"][0]
        m = state["exp_avg"]
        m.lerp_(self._local_grad(group, p, grad), 1 - beta1)  # local gradient: nobody averaged it
        self.average_momentum_(index, m)
        self.segments_of(p).zero_gaps_(m.view(-1))
        self._adam_step(group, p, m, state["exp_avg_sq"], int(state["step"]))
