"""Staging an asynchronous save's pieces into host memory without holding training up.

[Note: async staging]
An async save writes, in a background thread, a snapshot of the pieces as they were when ``save``
was called, while training goes on. What ``save`` must do before returning is make that snapshot
safe from the next optimizer step, which changes the masters and optimizer states in place.

- Pieces in host memory (CPU training, offloaded states) are copied into the host arena before
  ``save`` returns: a memcpy, which the caller waits for.
- CUDA pieces, when the device has room for a second copy of them (:func:`device_room`): each is
  cloned on the device, on the training stream. Stream order makes the clones the state at the save;
  they read and write each byte once (21 GiB in about 15 ms on an H200, against ~0.9 s for the same
  bytes over PCIe into pinned memory, which is what the caller waited for before). Nothing needs
  fencing: the masters can change as soon as the clones are queued.
- CUDA pieces without that room: pieces the optimizer step alone changes (``step_only``: the
  engines' fp32 masters and their flat optimizer states) are read in place by the side stream, and
  the next optimizer step waits for that copy on the device (:meth:`Stager.fence`, called by
  ``Engines.step``), not on the host. The forward and backward between a save and the next step
  hide the copy, up to their length. Every other CUDA piece (module buffers, which a forward may
  update, scalar step counters, communication state) is copied on the training stream, in order.

Either way the device-to-host copies into the pinned arena, and the max-abs reductions the
non-finite refusal needs (save_errors.py), run on a side stream; the writer thread waits for the
side stream's event (:meth:`Staged.finish`) before it refuses or writes, and drops the clones
after that, which returns their memory to the caching allocator.

What this does not cover: a mutation of a ``step_only`` tensor by anything other than an optimizer
step between a save and the next step. Loads wait for the pending save first (sharded.py), and so
do the end of fit and teardown.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.checkpoint import save_errors
from lightning_zero.checkpoint.pieces import FlatPiece

SNAPSHOT_MARGIN_FRACTION = 0.05
"""Device memory kept free beyond the training step's own peak when taking a device snapshot (at
least 1 GiB): the caching allocator's fragmentation needs some."""


def aligned(n: int) -> int:
    """Byte offsets in the arena and the snapshot start on 64-byte boundaries (any dtype's view fits)."""
    return -(-n // 64) * 64


def tensor_of(value: Any) -> Optional[Tensor]:
    """The tensor an entry stores (a FlatPiece's source), or None."""
    t = value.source if isinstance(value, FlatPiece) else value
    return t if torch.is_tensor(t) else None


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def device_room(device: torch.device, need: int) -> bool:
    """Whether ``device`` can hold ``need`` more bytes through the next training step: what the driver
    and the caching allocator have free, less the step's own peak above what is held now (the high-water
    mark since the last reset) and a margin."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    headroom = max(torch.cuda.max_memory_allocated(device) - allocated, 0)
    margin = max(2**30, int(total * SNAPSHOT_MARGIN_FRACTION))
    return free + cached - need >= headroom + margin


class HostArena:
    """A host buffer reused by every async save (pinned when the pieces come from a GPU: allocating
    gigabytes of pinned memory per save would cost more than the copy)."""

    def __init__(self) -> None:
        self.buffer: Optional[Tensor] = None

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Have at least ``nbytes`` ready (pinning gigabytes takes seconds: done ahead of the first
        save, in the background, by ``ShardedCheckpointer.reserve``)."""
        if self.buffer is None or self.buffer.numel() < nbytes or (pin and not self.buffer.is_pinned()):
            self.buffer = None
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def view(self, offset: int, like: Tensor) -> Tensor:
        assert self.buffer is not None
        return self.buffer[offset : offset + nbytes(like)].view(like.dtype).view(like.shape)


@dataclasses.dataclass
class Staged:
    """One save's pieces in host memory, some still arriving until ``ready`` has passed."""

    entries: dict[str, Any]
    """The checkpoint's entries with every tensor replaced by its host copy."""
    order: list[str]
    """Every key, in the entries' order (the refusal names the first bad one)."""
    ready: Optional[Any] = None
    """A CUDA event recorded after the last copy and reduction (None: everything is already there)."""
    probe_keys: list[str] = dataclasses.field(default_factory=list)
    probe: Optional[Tensor] = None
    """Pinned host max-abs of the floating CUDA pieces, by ``probe_keys`` (filled by ``ready``)."""
    held: list[Tensor] = dataclasses.field(default_factory=list)
    """Device tensors the side stream reads (the clones, the reductions): dropped once ``ready`` passed."""
    where: str = "host"
    """How the CUDA pieces were staged: 'device snapshot', 'in place' or 'host' (no CUDA pieces)."""

    def finish(self) -> Optional[str]:
        """In the writer thread: wait for the copies, release the device buffers; the key of the first
        entry holding NaN or inf, or None (host pieces are checked here, CUDA ones by their probe)."""
        if self.ready is not None:
            self.ready.synchronize()
        self.held = []
        bad: set[str] = set()
        if self.probe is not None:
            finite = torch.isfinite(self.probe).tolist()
            bad |= {k for k, ok in zip(self.probe_keys, finite) if not ok}
        probed = set(self.probe_keys)
        host = {k: v for k, v in self.entries.items() if k not in probed}
        first_host = save_errors.first_nonfinite(host)
        if first_host is not None:
            bad.add(first_host)
        position = {k: i for i, k in enumerate(self.order)}
        return min(bad, key=position.__getitem__) if bad else None


class Stager:
    """Stages async saves for one checkpointer: its host arena, and per device a side stream and the
    event the next optimizer step waits for (see the Note)."""

    def __init__(self) -> None:
        self.arena = HostArena()
        self._streams: dict[torch.device, Any] = {}
        self._fence: Optional[tuple[torch.device, Any]] = None

    def fence(self) -> None:
        """Before an optimizer step: the training stream waits (on the device) for a pending in-place copy."""
        pending, self._fence = self._fence, None
        if pending is not None:
            device, event = pending
            torch.cuda.current_stream(device).wait_event(event)

    def _side(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def stage(self, entries: dict[str, Any], step_only: set[int]) -> Staged:
        """Copy ``entries`` into the arena (see the Note); ``step_only``: storage pointers only an
        optimizer step changes."""
        tensors = {k: t.detach() for k, v in entries.items() if (t := tensor_of(v)) is not None}
        cuda = {k: t for k, t in tensors.items() if t.is_cuda}
        devices = {t.device for t in cuda.values()}
        offsets: dict[str, int] = {}
        offset = 0
        for k, t in tensors.items():
            offsets[k] = offset
            offset += aligned(nbytes(t))
        self.arena.reserve(offset, pin=bool(cuda) and torch.cuda.is_available())
        host: dict[str, Tensor] = {k: self.arena.view(offsets[k], t) for k, t in tensors.items()}
        staged = Staged(entries={}, order=list(entries))
        for k, t in tensors.items():
            if not t.is_cuda:
                host[k].copy_(t)
        if len(devices) == 1:
            self._stage_cuda(cuda, host, step_only, next(iter(devices)), staged)
        else:  # pieces on several devices (not a layout the strategies make): copied before returning
            for k, t in cuda.items():
                host[k].copy_(t)
        for k, v in entries.items():
            if k in host:
                staged.entries[k] = dataclasses.replace(v, source=host[k]) if isinstance(v, FlatPiece) else host[k]
            else:
                staged.entries[k] = copy.deepcopy(v)
        return staged

    def _stage_cuda(self, cuda: dict[str, Tensor], host: dict[str, Tensor], step_only: set[int],
                    device: torch.device, staged: Staged) -> None:
        need = sum(aligned(nbytes(t)) for t in cuda.values())
        training = torch.cuda.current_stream(device)
        snapshot = device_room(device, need)
        try:
            sources = _sources(cuda, step_only, snapshot, staged)
        except torch.OutOfMemoryError:  # the room was misjudged: the step-only pieces are read in place
            snapshot = False
            sources = _sources(cuda, step_only, snapshot, staged)
        staged.where = "device snapshot" if snapshot else "in place"
        side = self._side(device)
        side.wait_stream(training)
        with torch.cuda.stream(side):
            norms = []
            for k, src in sources.items():
                host[k].copy_(src, non_blocking=True)
                if src.is_floating_point() and src.numel():
                    staged.probe_keys.append(k)
                    norms.append(torch.linalg.vector_norm(src, ord=math.inf).float())
            if norms:
                probe = torch.stack(norms)
                staged.probe = torch.empty(probe.shape, dtype=probe.dtype, pin_memory=True)
                staged.probe.copy_(probe, non_blocking=True)
                staged.held.append(probe)
            event = torch.cuda.Event()
            event.record(side)
        staged.ready = event
        if not snapshot:
            self._fence = (device, event)


def _sources(cuda: dict[str, Tensor], step_only: set[int], clone_all: bool, staged: Staged) -> dict[str, Tensor]:
    """What the side stream copies from: a clone per piece, in stream order (all of them for a device
    snapshot; otherwise those a forward may change), or the piece itself (step-only, fenced). One clone per
    piece, not one buffer: the caching allocator serves them from blocks it holds, where a buffer of the whole
    size needed a fresh cudaMalloc of it (1.8 s for 42 GB on an H200, 2026-11-29)."""
    staged.held = []
    sources: dict[str, Tensor] = {}
    for k, t in cuda.items():
        if clone_all or t.untyped_storage().data_ptr() not in step_only:
            sources[k] = t.clone()
            staged.held.append(sources[k])
        else:
            sources[k] = t
    return sources
