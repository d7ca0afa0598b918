"""Exact-size pinned host blocks for offloaded checkpoints, reused from one step to the next.

[Note: exact-size checkpoint blocks]
torch's caching pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to a power of
two. At long sequence one checkpoint is large (a Llama-8B layer's input at 300K tokens is 2.3 GiB, rounded to
4 GiB), so the host would hold up to twice the checkpoints it stores, and the longest sequence a machine trains
would be set by the rounding. Checkpoints of size >= :data:`EXACT_MIN_BYTES` are therefore taken from
:class:`HostBlocks`: page-locked in place at their exact size (offload/pinned.py's ``HostPool``, cudaHostRegister)
the first time a size is needed, and handed back when the autograd graph lets go of the checkpoint, to be reused by
the next checkpoint of that size (every step asks for the same sizes, so registration is paid in the first step
only). A block is reused only after the copies that read or wrote it have finished (their events are synchronised
on reuse: they are long done by then). Smaller checkpoints keep torch's caching allocator, whose rounding is
harmless at their size. Blocks stay registered until :meth:`HostBlocks.release` (or the offloader is freed).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_zero.offload.pinned import HostPool

EXACT_MIN_BYTES = 16 << 20
"""Checkpoints at least this large get exact-size blocks; below it the caching allocator's rounding costs little."""


class HostBlocks:
    """A free list of exact-size host blocks, keyed by size in bytes ([Note: exact-size checkpoint blocks])."""

    def __init__(self, pin: bool) -> None:
        self._pool = HostPool(pin=pin)
        self._free: dict[int, list[tuple[Tensor, Sequence[Any]]]] = {}
        weakref.finalize(self, HostPool.release, self._pool)

    @property
    def capacity_bytes(self) -> int:
        """Host bytes held by blocks, in use or free."""
        return self._pool.allocated

    def take(self, nbytes: int) -> Tensor:
        """A uint8 host tensor of exactly ``nbytes``: a freed block of that size, else a new one."""
        bucket = self._free.get(nbytes)
        if bucket:
            block, events = bucket.pop()
            for event in events:
                if event is not None:
                    event.synchronize()
            return block
        return self._pool.empty(nbytes, torch.uint8)

    def give_back(self, block: Tensor, events: Sequence[Any]) -> None:
        """``block`` may be reused once ``events`` (the copies that used it; None entries ignored) have run."""
        self._free.setdefault(block.numel(), []).append((block, list(events)))

    def release(self) -> None:
        """Unregister and drop every block (those still referenced elsewhere stay alive, unpinned)."""
        self._free.clear()
        self._pool.release()
