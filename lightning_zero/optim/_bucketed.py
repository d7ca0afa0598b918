"""The step loop shared by FusedAdam and FusedLamb: closure, amp scaling hand-off, bucketing.

Both optimizers step their parameters in device buckets of one dtype (see ``_buckets.py``) and
differ only in what one bucket's step does (``_step_bucket``), so the loop lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from lightning_zero.optim._buckets import Bucket, bucket_group, on_device
from lightning_zero.optim._common import align, all_params, check_group


class BucketedOptimizer(torch.optim.Optimizer):
    """Base of the multi-tensor device optimizers; subclasses implement ``_step_bucket``."""

    _display_name: ClassVar[str] = "BucketedOptimizer"

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        grads: Sequence[Tensor | None] | None = None,
        out16: Sequence[Tensor | None] | None = None,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # GradScaler hands these over as attributes when _step_supports_amp_scaling is set
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        params = all_params(self.param_groups)
        grads_in, outs = align(grads, params, "grads"), align(out16, params, "out16")
        first = 0
        for group in self.param_groups:
            check_group(group, self._display_name)
            for bucket in bucket_group(group, self.state, grads_in, outs, first):
                self._step_bucket(bucket, group, on_device(grad_scale, bucket.device), on_device(found_inf, bucket.device))
            first += len(group["params"])
        return loss

    def _step_bucket(self, b: Bucket, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        raise NotImplementedError
