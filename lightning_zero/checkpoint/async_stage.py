"""Staging an asynchronous save's pieces into host memory without holding training up.

[Note: async staging]
An async save writes, in a background thread, a snapshot of the pieces as they were when ``save``
was called, while training goes on. What ``save`` must do before returning is make that snapshot
safe from the next optimizer step, which changes the masters and optimizer states in place.

- Pieces in host memory (CPU training, offloaded states) are copied into the host arena before
  ``save`` returns: a memcpy, which the caller waits for.
- CUDA pieces, when the device has room for a second copy of them (:func:`device_room`): each is
  cloned on the device, on the training stream. Stream order makes the clones the state at the save;
  they read and write each byte once at device bandwidth (milliseconds for 21 GiB on an H200, where
  the copy of the same bytes into pinned memory held the caller 0.91 s, 2026-11-29). Nothing needs
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

A snapshot's device-to-host copies are issued by the writer thread, in ``D2H_CHUNK_BYTES`` pieces,
one in flight (:func:`copy_in_chunks`), not queued whole by ``save``: the GPU's copy engine serves
device-to-host copies in order, so any small one the training stream makes meanwhile (a loss's
``.item()``, a logged metric) waited for all of them. On 4 H200s the first step after a save of the
8B shape took 0.35 s longer than the others, the 21 GiB copy's own time, while nothing in it waited
for the side stream; a lone H200 showed why: ``.item()`` took 0.309 s behind a 16 GiB copy, against
4.9 ms behind 256 MiB pieces issued one at a time, at the same bandwidth (54.4 against 55.2 GB/s;
``benchmarks/d2h_contention.py``, RESULTS.md 2026-11-29 20:22). The in-place copy stays queued
whole at the save: the next optimizer step waits for all of it anyway.

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


D2H_CHUNK_BYTES = 256 << 20
"""Largest device-to-host copy a snapshot queues at once: what a small copy of the training stream
may wait behind (4.9 ms at an H200's 55 GB/s; see the Note)."""


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
        """``like``'s shape and dtype at ``offset`` (contiguous)."""
        assert self.buffer is not None
        return self.buffer[offset : offset + nbytes(like)].view(like.dtype).view(like.shape)


@dataclasses.dataclass
class _Region:
    """Bytes ``[lo, hi)`` of one storage that some pieces view (a ZeRO partition's pieces are contiguous
    slices of one flat buffer: copied as one range, not one copy per piece), or one non-contiguous piece."""

    device: torch.device
    source: Tensor
    """uint8 view of the range (or the non-contiguous piece itself)."""
    lo: int
    pieces: list[tuple[str, Tensor]]
    """(key, live tensor) of the pieces in the range."""
    step_only: bool = False
    host: Optional[Tensor] = None
    """Its copy in the arena (uint8 for a range)."""
    probe_at: Optional[int] = None
    """Index of its max-abs in the staged probe (floating ranges of one dtype only)."""

    @property
    def dtype(self) -> Optional[torch.dtype]:
        dtypes = {t.dtype for _, t in self.pieces}
        return dtypes.pop() if len(dtypes) == 1 else None

    def host_piece(self, t: Tensor) -> Tensor:
        """The arena copy of piece ``t`` of this region."""
        assert self.host is not None
        if self.host.dtype != torch.uint8 or self.source is t:
            return self.host
        start = t.storage_offset() * t.element_size() - self.lo
        return self.host[start : start + nbytes(t)].view(t.dtype).view(t.shape)


def _regions(tensors: dict[str, Tensor]) -> list[_Region]:
    """Group the pieces by the storage they view; a range viewed sparsely (more than a quarter of it
    between pieces) is split back into one region per piece."""
    by_storage: dict[tuple[torch.device, int], list[tuple[str, Tensor]]] = {}
    out: list[_Region] = []
    for k, t in tensors.items():
        if t.is_contiguous() and t.numel():
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((k, t))
        else:
            out.append(_Region(t.device, t, 0, [(k, t)]))
    for (device, _), pieces in by_storage.items():
        spans = [_span(t) for _, t in pieces]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if hi - lo > 1.25 * sum(b - a for a, b in spans) + 4096:
            groups = [([p], [span]) for p, span in zip(pieces, spans)]
        else:
            groups = [(pieces, spans)]
        for group, group_spans in groups:
            g_lo, g_hi = min(a for a, _ in group_spans), max(b for _, b in group_spans)
            storage = group[0][1].untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, g_lo, (g_hi - g_lo,))
            out.append(_Region(device, raw, g_lo, group))
    return out


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of its storage a contiguous tensor views."""
    lo = t.storage_offset() * t.element_size()
    return lo, lo + nbytes(t)


@dataclasses.dataclass
class Staged:
    """One save's pieces in host memory, some still arriving until ``ready`` has passed."""

    template: dict[str, Any]
    """The checkpoint's entries as given (tensors still the live ones: replaced by :meth:`finish`)."""
    regions: list[_Region]
    ready: Optional[Any] = None
    """A CUDA event recorded after the last copy and reduction (None: everything is already there)."""
    probe: Optional[Tensor] = None
    """Pinned host max-abs of the floating CUDA regions (filled by ``ready``)."""
    deferred: list[tuple[Tensor, Tensor]] = dataclasses.field(default_factory=list)
    """(device clone, arena view) pairs the writer thread copies after ``ready`` (a snapshot's)."""
    side: Optional[Any] = None
    """The side stream the deferred copies go on."""
    held: list[Tensor] = dataclasses.field(default_factory=list)
    """Device tensors the side stream reads (the clones, the reductions): dropped once ``ready`` passed."""
    where: str = "host"
    """How the CUDA pieces were staged: 'device snapshot', 'in place' or 'host' (no CUDA pieces)."""
    entries: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The entries with every tensor replaced by its host copy (built by :meth:`finish`)."""

    def finish(self) -> Optional[str]:
        """In the writer thread: wait for the copies, release the device buffers, build the host entries;
        the key of the first entry holding NaN or inf, or None."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.deferred:
            copy_in_chunks(self.deferred, self.side, D2H_CHUNK_BYTES)
            self.deferred = []
        self.held = []
        host: dict[str, Tensor] = {}
        to_check: dict[str, Tensor] = {}
        finite = torch.isfinite(self.probe).tolist() if self.probe is not None else []
        for region in self.regions:
            for k, t in region.pieces:
                host[k] = region.host_piece(t)
                if region.probe_at is None or not finite[region.probe_at]:
                    to_check[k] = host[k]  # unprobed (host memory, mixed dtypes), or holding a bad value
        for k, v in self.template.items():
            if k in host:
                self.entries[k] = dataclasses.replace(v, source=host[k]) if isinstance(v, FlatPiece) else host[k]
            else:
                self.entries[k] = v
        order = {k: i for i, k in enumerate(self.template)}
        return save_errors.first_nonfinite(dict(sorted(to_check.items(), key=lambda kv: order[kv[0]])))


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
        optimizer step changes. Non-tensor entries are copied as they are now."""
        tensors = {k: t.detach() for k, v in entries.items() if (t := tensor_of(v)) is not None}
        template = {k: (v if k in tensors else copy.deepcopy(v)) for k, v in entries.items()}
        regions = _regions(tensors)
        cuda = [r for r in regions if r.device.type == "cuda"]
        offset = 0
        offsets = []
        for r in regions:
            offsets.append(offset)
            offset += aligned(nbytes(r.source))
        self.arena.reserve(offset, pin=bool(cuda) and torch.cuda.is_available())
        for r, at in zip(regions, offsets):
            r.host = self.arena.view(at, r.source)
            r.step_only = r.source.untyped_storage().data_ptr() in step_only
        staged = Staged(template=template, regions=regions)
        for r in regions:
            if r.device.type != "cuda":
                r.host.copy_(r.source)  # type: ignore[union-attr]
        devices = {r.device for r in cuda}
        if len(devices) == 1:
            self._stage_cuda(cuda, next(iter(devices)), staged)
        else:  # pieces on several devices (not a layout the strategies make): copied before returning
            for r in cuda:
                r.host.copy_(r.source)  # type: ignore[union-attr]
        return staged

    def _stage_cuda(self, cuda: list[_Region], device: torch.device, staged: Staged) -> None:
        need = sum(aligned(nbytes(r.source)) for r in cuda)
        training = torch.cuda.current_stream(device)
        snapshot = device_room(device, need)
        try:
            sources = _sources(cuda, snapshot, staged)
        except torch.OutOfMemoryError:  # the room was misjudged: the step-only pieces are read in place
            snapshot = False
            sources = _sources(cuda, snapshot, staged)
        staged.where = "device snapshot" if snapshot else "in place"
        side = self._side(device)
        side.wait_stream(training)
        with torch.cuda.stream(side):
            norms = []
            for r, src in zip(cuda, sources):
                if snapshot:
                    staged.deferred.append((src, r.host))  # type: ignore[arg-type]
                else:
                    r.host.copy_(src, non_blocking=True)  # type: ignore[union-attr]
                dtype = r.dtype
                if dtype is not None and dtype.is_floating_point:
                    r.probe_at = len(norms)
                    values = src.view(dtype) if src.dtype == torch.uint8 else src
                    norms.append(torch.linalg.vector_norm(values, ord=math.inf).float())
            if norms:
                probe = torch.stack(norms)
                staged.probe = torch.empty(probe.shape, dtype=probe.dtype, pin_memory=True)
                staged.probe.copy_(probe, non_blocking=True)
                staged.held.append(probe)
            event = torch.cuda.Event()
            event.record(side)
        staged.ready, staged.side = event, side
        if not snapshot:
            self._fence = (device, event)


def _sources(cuda: list[_Region], clone_all: bool, staged: Staged) -> list[Tensor]:
    """What the side stream copies from, per region: a clone, in stream order (every region for a device
    snapshot; otherwise those a forward may change), or the range itself (step-only, fenced). Clones are
    per region, not one buffer of the whole size, so the caching allocator can serve them from blocks it
    holds (with one 42 GB buffer the first save of the 8B shape at 2 GPUs blocked 1.78 s, 2026-11-29)."""
    staged.held = []
    sources: list[Tensor] = []
    for r in cuda:
        if clone_all or not r.step_only:
            sources.append(r.source.clone())
            staged.held.append(sources[-1])
        else:
            sources.append(r.source)
    return sources


def copy_in_chunks(pairs: list[tuple[Tensor, Tensor]], side: Any, chunk: int) -> None:
    """Copy each (device, host) pair on ``side`` in ``chunk``-byte pieces, each issued once the one
    before has landed (see the Note); returns when all have. A non-contiguous pair goes whole. The
    side stream's device is made current first: in the writer thread the current device is 0."""
    with torch.cuda.device(side.device), torch.cuda.stream(side):
        for src, dst in pairs:
            if not (src.is_contiguous() and dst.is_contiguous()):
                dst.copy_(src, non_blocking=True)
                side.synchronize()
                continue
            flat_src, flat_dst = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
            for at in range(0, flat_src.numel(), chunk):
                flat_dst[at : at + chunk].copy_(flat_src[at : at + chunk], non_blocking=True)
                side.synchronize()
