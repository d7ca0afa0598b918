"""Stage-3 parameter partitions off the device: where a unit's 16-bit chunk comes from before its gather.

[Note: parameter offload]
Under ZeRO-3 each rank keeps its chunk of every unit's parameters (``ShardedParamGroup.shard16``)
and all-gathers a unit just before it runs. With ``offload_params='cpu'`` the chunks live in pinned
host memory; the engine's ``_gather_source`` copies one unit's chunk to the device (asynchronously,
on the stream the all-gather then waits on) right before its all-gather, so prefetching a unit
prefetches its copy too and the device holds only the gathered working set. With 'nvme' each
(param group, bucket) chunk is one swap file; it is read into a pinned slot of the store's
read-ahead ring (ring.py: read ahead for the units the prefetch will ask for next), checked, then
copied the same way; the slot is reused once that copy has finished. After the optimizer step the
updated 16-bit chunks are written back to host memory or, through the same ring, to the files.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from lightning_zero.offload.nvme import NvmeSwapper, SwapOp
from lightning_zero.offload.ring import ReadAheadRing, Slot
from lightning_zero.offload.swap_state import SwappedStore, make_placeholder, make_resident
from lightning_zero.zero.sharded_group import ShardedParamGroup


class NvmeParamStore(SwappedStore):
    """16-bit parameter chunks of stage-3 units in swap files ``g<group>.b<bucket>.param16.swap``."""

    def __init__(self, swapper: NvmeSwapper, groups: list[ShardedParamGroup], pin: bool, depth: int) -> None:
        """``depth``: slots of the read-ahead ring, :func:`ring_depth` of the engine's prefetch."""
        self.swapper = swapper
        self.groups = groups
        self.pin = pin
        self.ring = ReadAheadRing(depth, pin=pin)
        self._taken: dict[tuple[int, int], Slot] = {}
        """Chunks handed out by ``host_chunk`` whose device copy has not been released yet."""
        self._depth = 0
        self.resident = False
        self.fetched_bytes = 0

    @staticmethod
    def name(gi: int, bi: int) -> str:
        return f"g{gi}.b{bi}.param16"

    def _chunk(self, gi: int, bi: int) -> tuple[int, int]:
        b = self.groups[gi].layout.buckets[bi]
        return b.shard_offset, b.chunk

    def _in_memory(self) -> bool:
        return self.resident or self._depth > 0

    # ---------------------------------------------------------------- writing
    def _read_into(self, gi: int, bi: int) -> Any:
        """The ring's ``start`` for chunk (gi, bi): read its file into the slot's view."""

        def start(slot: Slot) -> list[SwapOp]:
            (view,) = slot.views([(self.groups[gi].compute_dtype, self._chunk(gi, bi)[1])])
            return [self.swapper.read(self.name(gi, bi), view)]

        return start

    def write(self, gi: int, bi: int, src: Tensor) -> None:
        """Start writing one bucket chunk (``src``: its values, any host tensor) to its file, from a ring
        slot that is reused once the write has finished."""
        self.ring.evict((gi, bi))  # a read-ahead of the old values is stale now
        slot = self.ring.acquire()
        (staging,) = slot.views([(src.dtype, src.numel())])
        staging.copy_(src)
        self.ring.release(slot, [self.swapper.write(self.name(gi, bi), staging)])

    def write_group(self, gi: int, src: Tensor) -> None:
        """All bucket chunks of group ``gi`` from a shard-shaped host tensor (after the step)."""
        fg = self.groups[gi]
        if self._in_memory():  # inside host_state (a checkpoint load): the resident copy is the truth
            assert fg.shard16 is not None
            fg.shard16.copy_(src)
            return
        for bi in range(len(self.groups[gi].layout.buckets)):
            off, n = self._chunk(gi, bi)
            self.write(gi, bi, src[off : off + n])
        self.ring.drain()  # every file complete (and its checksum recorded) before anything reads it

    def swap_out(self) -> None:
        """After the engine filled ``shard16``: write every chunk and free the host copies."""
        for gi, fg in enumerate(self.groups):
            assert fg.shard16 is not None
            self.write_group(gi, fg.shard16)
            make_placeholder(fg.shard16)

    # ---------------------------------------------------------------- reading
    def prefetch(self, keys: Iterable[tuple[int, int]]) -> None:
        """Start reading these (group, bucket) chunks in the background (read-ahead for gathers)."""
        if self._in_memory():
            return
        for key in keys:
            self.ring.read_ahead(key, self._read_into(*key))

    def host_chunk(self, gi: int, bi: int) -> Tensor:
        """The chunk in host memory (a pinned ring slot when read from its file; checksum verified).
        A chunk read from its file must be given back with :meth:`release` once copied."""
        fg = self.groups[gi]
        off, n = self._chunk(gi, bi)
        if self._in_memory():
            assert fg.shard16 is not None
            return fg.shard16[off : off + n]
        slot = self.ring.take((gi, bi), self._read_into(gi, bi))
        self._taken[(gi, bi)] = slot
        (staging,) = slot.views([(fg.compute_dtype, n)])
        self.fetched_bytes += staging.numel() * staging.element_size()
        return staging

    def release(self, gi: int, bi: int, done: Any = None) -> None:
        """``host_chunk``'s slot back to the ring; ``done`` (a CUDA event after the device copy out
        of it) is waited for before the slot is reused. A no-op for chunks served from memory."""
        slot = self._taken.pop((gi, bi), None)
        if slot is not None:
            self.ring.release(slot, done=done)

    def drop_reads(self) -> None:
        """Forget every read-ahead (after its I/O finished: its threads use the slot and the file's
        descriptor until then; rewriting the file would truncate it under the read)."""
        self.ring.evict_all()

    # ---------------------------------------------------------------- whole partitions
    def _swap_in_all(self) -> None:
        """``shard16`` resident inside ``host_state``; written back (in-place edits included) on exit."""
        self.drop_reads()
        self._read_all()

    def _swap_out_all(self) -> None:
        self.swap_out()

    def _read_all(self) -> None:
        for gi, fg in enumerate(self.groups):
            assert fg.shard16 is not None
            make_resident(fg.shard16)
            for bi in range(len(fg.layout.buckets)):
                off, n = self._chunk(gi, bi)
                slot = self.ring.take((gi, bi), self._read_into(gi, bi))
                (staging,) = slot.views([(fg.compute_dtype, n)])
                fg.shard16[off : off + n].copy_(staging)
                self.ring.release(slot)


def ring_depth(buckets_per_unit: int, prefetch_units: int) -> int:
    """Slots the parameter store's ring needs so that no read-ahead is evicted before its gather:
    the engine reads ahead the ``prefetch_units`` units after the next ones as well (sharded.py
    ``_prefetch``), so ``2 * prefetch_units`` units are ahead while one is being copied; one slot per
    bucket chunk of each (``buckets_per_unit``: the most any unit has), plus one for a write-back."""
    return (2 * max(0, prefetch_units) + 1) * max(1, buckets_per_unit) + 1


def copy_done(device: torch.device) -> Any:
    """An event after the copies issued so far on ``device``'s current stream (None off CUDA, where
    :func:`stage_to_device` copies synchronously)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def stage_to_device(host: Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A new device tensor with ``host``'s values, copied asynchronously (pinned source on CUDA).

    Always a separate tensor, also on a CPU-only machine, so CI runs the same copy as a GPU does.
    """
    out = torch.empty(host.numel(), dtype=dtype or host.dtype, device=device)
    out.copy_(host.reshape(-1), non_blocking=True)
    return out
