"""Receive buffers of the pipeline runtime, kept across micro-batches and steps.

[Note: reused receive buffers]
Every micro-batch receives an activation (all stages but the first) and a gradient (all but the last)
of the same shapes, step after step. The runtime takes its receive buffers from here and gives each
back once nothing reads it any more, so a steady-state step allocates no receive buffer (counted per
step in tests/pipeline: ``test_no_allocation_or_fill_per_microbatch``). A buffer is free again:

* an activation: after the backward of its micro-batch on this stage (autograd saved it for that
  backward; evaluation: after the forward), with its ``.grad`` dropped and ``requires_grad`` reset;
* a gradient: after the backward it fed.

A buffer is *not* given back while something still being sent, or kept for the user, shares its
storage: a layer that returns its input (an identity, a view) makes the received activation the
activation sent on, and autograd may make a received gradient the input's ``.grad`` that is sent
back up. Those sends complete in the background (runtime.py), so such a buffer is simply dropped and
a fresh one is allocated next time. Receiving into a given-back buffer is safe on CUDA too: the
process group orders a receive after the work already queued on the compute stream (the backward
that read the buffer), as it does for any tensor it is handed.

A gradient an input did not receive (the input did not reach the loss) is sent as zeros: one zero
tensor per shape, filled once and only ever read, instead of a ``zeros_like`` per micro-batch.

Buffers of shapes a training step did not receive are released at its end (a validation batch of
another size does not keep its buffers through training; evaluation releases nothing, so the training
buffers outlive a validation loop), so what stays allocated between steps is what a training step
holds at its peak anyway.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

Key = tuple[str, tuple[int, ...], torch.dtype]


class ReceiveBuffers:
    """Free receive buffers by (kind, shape, dtype), and the read-only zero gradients."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[Key, list[Tensor]] = {}
        self._zeros: dict[tuple[tuple[int, ...], torch.dtype], Tensor] = {}
        self._used: set[Key] = set()
        self.allocated = 0
        """Buffers allocated so far (tests read it; a steady state adds none)."""

    def take(self, kind: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """A buffer to receive into (uninitialised: the receive overwrites all of it)."""
        key = (kind, tuple(shape), dtype)
        self._used.add(key)
        free = self._free.get(key)
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(key[1], dtype=dtype, device=self.device)

    def give(self, kind: str, buffers: Iterable[Tensor], in_use: Sequence[Tensor] = ()) -> None:
        """Return buffers nothing reads any more, except those sharing storage with ``in_use`` (tensors
        still being sent or kept: see the note)."""
        busy = {t.untyped_storage().data_ptr() for t in in_use}
        for t in buffers:
            if t.untyped_storage().data_ptr() in busy:
                continue
            if t.requires_grad:
                t.grad = None
                t.requires_grad_(False)
            self._free.setdefault((kind, tuple(t.shape), t.dtype), []).append(t)

    def zeros(self, like: Tensor) -> Tensor:
        """A zero tensor shaped like ``like``, shared: never write into it."""
        key = (tuple(like.shape), like.dtype)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = torch.zeros(key[0], dtype=like.dtype, device=self.device)
        return z

    def end_step(self, training: bool) -> None:
        """After a training step: release the free buffers of shapes it did not receive. Evaluation
        releases nothing (the training buffers outlive a validation loop between two steps)."""
        if training:
            for key in [k for k in self._free if k not in self._used]:
                del self._free[key]
        self._used.clear()


__all__ = ["ReceiveBuffers"]
