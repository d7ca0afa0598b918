"""The CPU side of ZeRO-Offload: host gradient shards and the optimizer step over host masters.

[Note: which step runs]
The user's optimizer keeps its param groups (learning rates, schedulers, weight decay per group)
and its state dict in torch's layout. When it is Adam or AdamW (torch's or our CPUAdam) without
amsgrad/maximize, the step runs through the compiled CPU Adam op (``lightning_zero/ops``, one
OpenMP/SIMD pass that also writes the 16-bit copy of the updated shard straight into the pinned
upload buffer); if the op cannot be built, torch's fused CPU Adam runs instead (the op's own
fallback). Any other elementwise optimizer (SGD, ...) runs its own ``step()`` on the fp32 host
masters, followed by a separate 16-bit copy: slower, same results.

[Note: gradient landing and accumulation]
Reduced gradient chunks land in a pinned 16-bit host buffer (``landing``), copied device-to-host
as each bucket's reduce-scatter completes. With one micro-batch per step (the common case) the
CPU step reads them from there directly, unscaled and clipped by the op's ``grad_scale``: no fp32
copy and no extra pass. When micro-batches accumulate (stage 2/3 reduce every micro-batch), the
previous micro-batch's landing buffer is folded into an fp32 accumulator just before the next
backward's first copy would overwrite it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_zero.optim._common import adam_state
from lightning_zero.optim.torch_adam import torch_adam_step

_CPU = torch.device("cpu")

STEP_CHUNK = 1 << 25
"""Elements per CPU Adam call after backward. The compiled op releases the GIL, so the size does not
matter to it; torch's fallback (no compiler) allocates temporaries as large as its input, which this
bounds to a few hundred MB. (Here, beside the Adam it bounds, so that engine.py and masked.py both
import it without importing each other.)"""


# ---------------------------------------------------------------------------------------- Adam fast path
@dataclass(frozen=True)
class AdamHyper:
    """One param group's Adam hyper-parameters, captured when the step starts."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool


def adam_hyper(optimizer: torch.optim.Optimizer, group: dict) -> Optional[AdamHyper]:
    """The group's hyper-parameters if the compiled Adam can run it, else None (generic path)."""
    from lightning_zero.optim.cpu_adam import CPUAdam

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, CPUAdam)):
        return None
    if group.get("amsgrad") or group.get("maximize") or group.get("differentiable") or group.get("capturable"):
        return None
    lr = group["lr"]
    if torch.is_tensor(lr):
        lr = float(lr)
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    return AdamHyper(float(lr), beta1, beta2, float(group["eps"]), float(group["weight_decay"]), bool(decoupled))


def load_adam_op() -> Optional[object]:
    """The compiled CPU Adam module, or None (after one warning) when it cannot be built here."""
    from lightning_zero.ops.registry import get_op

    return get_op("cpu_adam").try_load()


def adam_update(
    op: Optional[object], master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, out16: Optional[Tensor],
    step: int, hyper: AdamHyper, grad_scale: float, threads: int,
) -> None:
    """One Adam/AdamW update of a flat fp32 range in place (``grad`` may be 16-bit; it is divided by
    ``grad_scale``); ``out16`` (16-bit) receives the updated values in the same pass."""
    if op is not None:
        op.adam_step(  # type: ignore[attr-defined]  # third-party typing gap: a cpp_extension module has no stubs
            master, grad, exp_avg, exp_avg_sq, out16, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
            eps=hyper.eps, weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode, step=step,
            grad_scale=grad_scale, num_threads=threads,
        )
        return
    steps = torch.tensor(float(step - 1))  # torch_adam_step increments it
    scale = None if grad_scale == 1.0 else torch.tensor(grad_scale)
    torch_adam_step(
        [master], [grad], [exp_avg], [exp_avg_sq], [steps], [out16], lr=hyper.lr, beta1=hyper.beta1,
        beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode,
        grad_scale=scale,
    )


def host_adam_state(optimizer: torch.optim.Optimizer, master: Tensor) -> dict:
    """torch.optim.Adam's state layout for ``master`` (created on first use, fp32, in host memory)."""
    return adam_state(optimizer.state[master], master, _CPU)


def generic_step(optimizer: torch.optim.Optimizer, masters: list[Tensor], grads: list[Tensor], coef: float) -> None:
    """Any elementwise torch optimizer on the host masters (fp32 gradients, scaled by ``coef``)."""
    for master, g in zip(masters, grads):
        g32 = g.to(master.dtype)  # the host gradient buffers are consumed by this step: scaled in place
        if coef != 1.0:
            g32.mul_(coef)
        master.grad = g32
    optimizer.step()
    for master in masters:
        master.grad = None


# ---------------------------------------------------------------------------------------- gradients
class HostGradShard:
    """Reduced gradients of one param group's shard in host memory (see [Note: gradient landing])."""

    def __init__(self, numel: int, dtype: torch.dtype, alloc: Callable[[int, torch.dtype], Tensor],
                 spares: int = 0) -> None:
        self.numel = numel
        self._alloc = alloc
        self.landing = alloc(numel, dtype)
        self.spares = [alloc(numel, dtype) for _ in range(spares)]
        """Extra landing buffers (delayed update: the CPU step reads one while backward fills another)."""
        self.acc: Optional[Tensor] = None
        self._acc_spare: Optional[Tensor] = None
        self.acc_valid = False
        self.fresh = False
        """``landing`` holds a micro-batch not yet folded into ``acc``."""

    def fold(self) -> None:
        """Move the landed micro-batch into the fp32 accumulator (before the next one overwrites it)."""
        if not self.fresh:
            return
        if self.acc is None:
            self.acc = self._alloc(self.numel, torch.float32)
        if self.acc_valid:
            self.acc.add_(self.landing)
        else:
            self.acc.copy_(self.landing)
            self.acc_valid = True
        self.fresh = False

    def value(self) -> Tensor:
        """This step's gradient: ``landing`` itself for a single micro-batch, else the accumulator."""
        if self.acc_valid:
            self.fold()
            assert self.acc is not None
            return self.acc
        if not self.fresh:  # no backward reduced anything since the last step
            self.landing.zero_()
        return self.landing

    def reset(self) -> None:
        self.fresh = False
        self.acc_valid = False

    def rotate(self) -> None:
        """Hand the current landing buffer to a background step and land the next gradients elsewhere."""
        if self.spares:
            self.spares.append(self.landing)
            self.landing = self.spares.pop(0)
            self.acc, self._acc_spare = self._acc_spare, self.acc


def sum_of_squares(grads: list[Tensor], block: int = 1 << 24) -> float:
    """Local squared L2 norm of host gradients in float64, block by block (no full-size temporaries)."""
    total = 0.0
    for g in grads:
        flat = g.reshape(-1)
        for lo in range(0, flat.numel(), block):
            part = flat[lo : lo + block]
            total += float(torch.linalg.vector_norm(part, dtype=torch.float64) ** 2)
    return total

