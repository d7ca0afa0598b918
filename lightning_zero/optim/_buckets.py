"""Group a param group's tensors into buckets one kernel call can take.

A compiled multi-tensor call needs one device and one dtype per role (param,
grad, 16-bit copy); this splits a group by those, keeping optimizer order, and
creates torch-Adam-layout state on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_zero.optim._common import adam_state, grad_of


@dataclass
class Bucket:
    """Same-device, same-dtypes tensors of one param group, in optimizer order."""

    device: torch.device
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)
    outs: list[Tensor | None] = field(default_factory=list)

    @property
    def has_out(self) -> bool:
        return self.outs[0] is not None


def bucket_group(
    group: dict, state: dict, grads: list[Tensor | None], outs: list[Tensor | None], first: int
) -> list[Bucket]:
    """Buckets of ``group``; ``grads``/``outs`` are indexed by optimizer order from ``first``."""
    buckets: dict[tuple, Bucket] = {}
    for offset, p in enumerate(group["params"]):
        grad = grad_of(p, grads[first + offset])
        if grad is None:
            continue
        out = outs[first + offset]
        key = (p.device, p.dtype, grad.dtype, None if out is None else out.dtype)
        bucket = buckets.setdefault(key, Bucket(device=p.device))
        st = adam_state(state[p], p, p.device)
        bucket.params.append(p)
        bucket.grads.append(grad.contiguous())
        bucket.exp_avgs.append(st["exp_avg"])
        bucket.exp_avg_sqs.append(st["exp_avg_sq"])
        bucket.steps.append(st["step"])
        bucket.outs.append(out)
    return list(buckets.values())


def on_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """A scale/found-inf scalar on ``device`` as float32 (no sync if already there)."""
    if t is None:
        return None
    return t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
