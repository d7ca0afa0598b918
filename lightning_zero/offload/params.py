"""Stage-3 parameter partitions off the device: where a unit's 16-bit chunk comes from before its gather.

[Note: parameter offload]
Under ZeRO-3 each rank keeps its chunk of every unit's parameters (``ShardedParamGroup.shard16``)
and all-gathers a unit just before it runs. With ``offload_params='cpu'`` the chunks live in pinned
host memory; the engine's ``_gather_source`` copies one unit's chunk to the device (asynchronously,
on the stream the all-gather then waits on) right before its all-gather, so prefetching a unit
prefetches its copy too and the device holds only the gathered working set. With 'nvme' each
(param group, unit) chunk is one swap file; a unit's file is read into a pinned staging buffer
(read ahead for the units the prefetch will ask for next), checked, then copied the same way.
After the optimizer step the updated 16-bit chunks are written back to host memory or to the files.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor

from lightning_zero.offload.nvme import NvmeSwapper, SwapOp
from lightning_zero.offload.pinned import aligned_empty
from lightning_zero.offload.swap_state import SwappedStore, make_placeholder, make_resident
from lightning_zero.zero.sharded_group import ShardedParamGroup


class NvmeParamStore(SwappedStore):
    """16-bit parameter chunks of stage-3 units in swap files ``g<group>.b<bucket>.param16.swap``."""

    def __init__(self, swapper: NvmeSwapper, groups: list[ShardedParamGroup], pin: bool) -> None:
        self.swapper = swapper
        self.groups = groups
        self.pin = pin
        self._reads: dict[tuple[int, int], tuple[SwapOp, Tensor]] = {}
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
    def write(self, gi: int, bi: int, src: Tensor) -> SwapOp:
        """Start writing one bucket chunk (``src``: its values, any host tensor) to its file."""
        staging = aligned_empty(src.numel(), src.dtype)
        staging.copy_(src)
        return self.swapper.write(self.name(gi, bi), staging)  # the pending write keeps staging alive

    def write_group(self, gi: int, src: Tensor) -> None:
        """All bucket chunks of group ``gi`` from a shard-shaped host tensor (after the step)."""
        fg = self.groups[gi]
        if self._in_memory():  # inside host_state (a checkpoint load): the resident copy is the truth
            assert fg.shard16 is not None
            fg.shard16.copy_(src)
            return
        ops = []
        for bi in range(len(self.groups[gi].layout.buckets)):
            off, n = self._chunk(gi, bi)
            self._drop_read((gi, bi))  # a read-ahead of the old values is stale now
            ops.append(self.write(gi, bi, src[off : off + n]))
        for op in ops:
            op.wait()

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
            if key in self._reads:
                continue
            off, n = self._chunk(*key)
            staging = aligned_empty(n, self.groups[key[0]].compute_dtype, pin=self.pin)
            self._reads[key] = (self.swapper.read(self.name(*key), staging), staging)

    def host_chunk(self, gi: int, bi: int) -> Tensor:
        """The chunk in host memory (pinned staging when read from its file; checksum verified)."""
        fg = self.groups[gi]
        off, n = self._chunk(gi, bi)
        if self._in_memory():
            assert fg.shard16 is not None
            return fg.shard16[off : off + n]
        if (gi, bi) not in self._reads:
            self.prefetch([(gi, bi)])
        op, staging = self._reads.pop((gi, bi))
        op.wait()
        self.fetched_bytes += staging.numel() * staging.element_size()
        return staging

    def _drop_read(self, key: tuple[int, int]) -> None:
        """Forget a read-ahead, after it finished: its threads write into the staging buffer and use
        the file's descriptor until then (dropping it early freed the buffer under them and leaked
        the descriptor; rewriting the file truncated it under the read)."""
        pending = self._reads.pop(key, None)
        if pending is not None:
            try:
                pending[0].wait()
            except Exception:  # a stale read-ahead's error does not matter; the next real read reports it
                pass

    def drop_reads(self) -> None:
        for key in list(self._reads):
            self._drop_read(key)

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
                staging = aligned_empty(n, fg.compute_dtype)
                self.swapper.read(self.name(gi, bi), staging).wait()
                fg.shard16[off : off + n].copy_(staging)


def stage_to_device(host: Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A new device tensor with ``host``'s values, copied asynchronously (pinned source on CUDA).

    Always a separate tensor, also on a CPU-only machine, so CI runs the same copy as a GPU does.
    """
    out = torch.empty(host.numel(), dtype=dtype or host.dtype, device=device)
    out.copy_(host.reshape(-1), non_blocking=True)
    return out
