"""Partial offload: the share of an offloaded optimizer partition that stays on the device.

[Note: partial offload]
With ``offload_ratio`` r < 1 each param group's partition is cut at a bucket boundary: the leading
buckets (about r of the elements) are the *host share*, stepped by the CPU Adam exactly as with full
offload; the trailing buckets are the *device share*: fp32 master, Adam moments and an fp32
gradient accumulator on the device, stepped by torch's fused Adam after backward (about 8 ms per
billion parameters on an H200, against ~0.3 s on 16 host cores). The host share takes the leading
buckets because they hold the last layers: their gradients land first, so the CPU step that runs
during backward overlaps the rest of backward longest, while the device share's gradients, landing
last, need no copy at all.

Nothing outside the offload engine sees the split. :class:`DeviceShare` is a member of the host
optimizer (host_optimizer.py: ``share``), which keeps full-size host masters and Adam
states; the device share's part of them is a *mirror*, brought up to date on entry to
``host_state()`` (checkpoints, consolidation, user edits read them there) and pushed back to the
device on exit when something wrote to it (a checkpoint load). Host memory is therefore what full
offload needs; the device pays 16 bytes per element of its share (18 with a 16-bit compute copy).
Both shares use the same step count and hyper-parameters, so results match full offload and ddp
up to the two Adam kernels' rounding (tests compare against ddp).

``auto``: the first optimizer step runs fully offloaded; after it the engine measures the device's
peak memory and free memory, and moves as much of the partition's tail to the device as fits with
10% headroom (:func:`auto_device_numel`). Each rank decides for itself: a split is local to the
rank's partition and changes no collective.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.optim.torch_adam import torch_adam_step
from lightning_zero.zero.partition import FlatLayout

HEADROOM = 0.10
"""Fraction of the device's memory that ``auto`` leaves free (allocator fragmentation, spikes)."""


def split_at_ratio(layout: FlatLayout, ratio: float, round_host_up: bool = False) -> int:
    """The shard offset where the device share starts: the bucket boundary whose host share is
    nearest to ``ratio`` of the partition. ``round_host_up=True`` (``auto``) takes the next boundary
    up instead, so the device share never exceeds what was measured to fit."""
    n = layout.shard_numel
    if ratio >= 1.0 or n == 0:
        return n
    if ratio <= 0.0:
        return 0
    target = ratio * n
    bounds = [b.shard_offset for b in layout.buckets] + [n]
    if round_host_up:
        return min(x for x in bounds if x >= target)
    return min(bounds, key=lambda x: (abs(x - target), x))


def device_bytes_per_element(compute_dtype: torch.dtype) -> int:
    """Device memory of one device-share element: fp32 master, two moments, fp32 gradient, and the
    16-bit copy the all-gather or gather sends when computing in 16 bits."""
    return 16 + (0 if compute_dtype == torch.float32 else torch.empty((), dtype=compute_dtype).element_size())


def auto_device_numel(total_bytes: int, peak_bytes: int, compute_dtype: torch.dtype) -> int:
    """Elements that fit on the device next to a step that peaked at ``peak_bytes``."""
    free = int(total_bytes * (1.0 - HEADROOM)) - peak_bytes
    return max(0, free // device_bytes_per_element(compute_dtype))


def auto_ratio(shard_numels: Sequence[int], device_numel: int) -> float:
    """The host fraction that leaves ``device_numel`` elements of the partition on the device."""
    total = sum(shard_numels)
    if total == 0:
        return 1.0
    return max(0.0, 1.0 - device_numel / total)


class _GroupShare:
    """One param group's device share: elements ``[split, numel)`` of its partition."""

    def __init__(self, split: int, numel: int, device: torch.device, compute_dtype: torch.dtype) -> None:
        n = numel - split
        self.split = split
        self.master = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)
        self.out16: Optional[Tensor] = None if compute_dtype == torch.float32 else torch.empty(n, dtype=compute_dtype, device=device)
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)

    def source(self) -> Tensor:
        """The updated values in the compute dtype (what gathers send)."""
        return self.master if self.out16 is None else self.out16


class DeviceShare:
    """The device shares of every param group of one engine (see [Note: partial offload])."""

    def __init__(self, splits: Sequence[int], numels: Sequence[int], device: torch.device,
                 compute_dtype: torch.dtype) -> None:
        self.splits = list(splits)
        self.numels = list(numels)
        self.device = device
        self._groups: list[Optional[_GroupShare]] = [
            _GroupShare(s, n, device, compute_dtype) if s < n else None for s, n in zip(splits, numels)
        ]

    @property
    def numel(self) -> int:
        return sum(n - s for s, n in zip(self.splits, self.numels))

    def owns(self, gi: int, lo: int) -> bool:
        """Whether the range starting at ``lo`` (bucket-aligned) of group ``gi`` is on the device."""
        return lo >= self.splits[gi]

    def group(self, gi: int) -> _GroupShare:
        g = self._groups[gi]
        assert g is not None, f"param group {gi} has no device share"
        return g

    # ------------------------------------------------------------------------------ gradients
    def land(self, gi: int, lo: int, reduced: Tensor) -> None:
        """Accumulate a reduced gradient chunk starting at shard offset ``lo`` (after its collective)."""
        g = self.group(gi)
        g.grad[lo - g.split : lo - g.split + reduced.numel()].add_(reduced)

    def grad_sq(self, chunk_sq: Optional[Callable[[int, int, Tensor], Tensor]] = None) -> float:
        """Squared L2 norm of the accumulated device-share gradients; ``chunk_sq(gi, shard_offset, grad)``
        weighs them instead where given (tensor parallelism's replicated elements, offload/engine.py)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for gi, g in enumerate(self._groups):
            if g is not None and g.grad.numel():
                if chunk_sq is not None:
                    total += chunk_sq(gi, g.split, g.grad).double()
                else:
                    total += torch.linalg.vector_norm(g.grad, dtype=torch.float64) ** 2
        return float(total)

    def zero_grads(self) -> None:
        for g in self._groups:
            if g is not None:
                g.grad.zero_()

    # ------------------------------------------------------------------------------ the step
    def step(self, gi: int, step: int, hyper: AdamHyper, grad_scale: float) -> None:
        """Adam/AdamW on group ``gi``'s device share: the same step count and hyper-parameters as the
        host share's CPU step (``grad_scale`` divides the gradients, as the CPU op's does)."""
        g = self._groups[gi]
        if g is None or g.master.numel() == 0:
            return
        g.step_t.fill_(step - 1)  # torch_adam_step counts it up
        scale = None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32, device=self.device)
        torch_adam_step(
            [g.master], [g.grad], [g.exp_avg], [g.exp_avg_sq], [g.step_t], [g.out16], lr=hyper.lr, beta1=hyper.beta1,
            beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode,
            grad_scale=scale,
        )

    def step_pieces(self, gi: int, ranges: list[tuple[int, int, int]], steps: int, hyper: AdamHyper,
                    grad_scale: float) -> None:
        """Like :meth:`step`, for the used pieces ``(lo, hi, count)`` of the shard only, each with its own step
        count; the rest (and their moments) stay as they are (zero/unused.py)."""
        g = self._groups[gi]
        if g is None or g.master.numel() == 0:
            return
        lo_share, hi_share = g.split, g.split + g.master.numel()
        scale = None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32, device=self.device)
        for a, b, count in ranges:
            a, b = max(a, lo_share) - lo_share, min(b, hi_share) - lo_share
            if a < b:
                step_t = torch.full((), count - 1.0, dtype=torch.float32, device=self.device)
                torch_adam_step(
                    [g.master[a:b]], [g.grad[a:b]], [g.exp_avg[a:b]], [g.exp_avg_sq[a:b]], [step_t],
                    [None if g.out16 is None else g.out16[a:b]], lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                    eps=hyper.eps, weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode, grad_scale=scale,
                )
        g.step_t.fill_(steps)

    def source(self, gi: int, lo: int, hi: int) -> Tensor:
        """Shard range ``[lo, hi)`` (inside the device share) of the updated values, compute dtype."""
        g = self.group(gi)
        return g.source()[lo - g.split : hi - g.split]

    # ------------------------------------------------------------------------------ the host mirror
    def pull(self, gi: int, master: Tensor, exp_avg: Optional[Tensor], exp_avg_sq: Optional[Tensor]) -> None:
        """Copy group ``gi``'s device share into the full-size host tensors' tail."""
        g = self._groups[gi]
        if g is None:
            return
        s = g.split
        master[s:].copy_(g.master)
        if exp_avg is not None:
            exp_avg[s:].copy_(g.exp_avg)
        if exp_avg_sq is not None:
            exp_avg_sq[s:].copy_(g.exp_avg_sq)

    def push(self, gi: int, master: Tensor, exp_avg: Optional[Tensor], exp_avg_sq: Optional[Tensor]) -> None:
        """Copy the host tensors' tail into group ``gi``'s device share (after a load or an edit)."""
        g = self._groups[gi]
        if g is None:
            return
        s = g.split
        g.master.copy_(master[s:], non_blocking=True)
        for dst, src in ((g.exp_avg, exp_avg), (g.exp_avg_sq, exp_avg_sq)):
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src[s:], non_blocking=True)
        if g.out16 is not None:
            g.out16.copy_(g.master)

    @contextmanager
    def mirrored(self, host: Callable[[int], HostTrio]) -> Generator[None, None, None]:
        """Inside the block the host tensors ``host(gi) = (master, exp_avg, exp_avg_sq)`` of each group
        hold the device share's current values; if something wrote to them there (or replaced them:
        a checkpoint load installs new state tensors) they go back to the device on exit."""
        entry: list[list[tuple[Any, int]]] = []
        for gi in range(len(self._groups)):
            trio = host(gi)
            self.pull(gi, *trio)
            entry.append(host_identity(trio))
        try:
            yield
        finally:
            for gi in range(len(self._groups)):
                trio = host(gi)
                if host_changed(trio, entry[gi]):
                    self.push(gi, *trio)


HostTrio = tuple[Tensor, Optional[Tensor], Optional[Tensor]]
"""A param group's full-size host master and Adam moments (None: not created yet)."""


def host_identity(trio: HostTrio) -> list[tuple[Any, int]]:
    """Which tensors (weakly: a load may free them) at which in-place version."""
    return [(None, -1) if t is None else (weakref.ref(t), t._version) for t in trio]


def host_changed(trio: HostTrio, entry: list[tuple[Any, int]]) -> bool:
    """Whether a host tensor was written in place or replaced since ``entry``."""
    for t, (ref, version) in zip(trio, entry):
        if (t is None) != (ref is None) or (t is not None and (ref() is not t or t._version != version)):
            return True
    return False
