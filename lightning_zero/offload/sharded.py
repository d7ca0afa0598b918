"""Stage 3 with offload: the 16-bit partitions (the gather sources) off the device too.

What this adds to :class:`~lightning_zero.offload.engine.OffloadMixin` for ZeRO-3: where each
rank's 16-bit partition lives (``offload_params``: device, pinned host memory, or NVMe files read
ahead unit by unit), how a unit's chunk reaches the device before its all-gather
(``_gather_source``), and how the CPU step's result reaches the partitions (``_refresh_shards``: in
place for pinned host partitions, uploaded otherwise, written to the swap files for NVMe).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Generator, Iterable, Optional, cast

import torch
from torch import Tensor

from lightning_zero.offload.engine import OffloadMixin
from lightning_zero.offload.params import NvmeParamStore, copy_done, ring_depth, stage_to_device
from lightning_zero.zero.sharded_group import ShardedParamGroup

if TYPE_CHECKING:  # the engine this mixin goes in front of (engines.py), for the type checker
    from lightning_zero.zero.stage3 import Stage3Engine as _Stage3Base
else:
    _Stage3Base = object


class ParamOffloadMixin(OffloadMixin, _Stage3Base):
    """Stage 3: the 16-bit partitions off the device too (or only the optimizer, params='none')."""

    def _group_kwargs(self) -> dict[str, object]:
        kwargs = super()._group_kwargs()
        if self.offload.offload_params == "cpu":
            kwargs["shard16_factory"] = self.host.zeros
        elif self.offload.offload_params == "nvme":
            kwargs["shard16_factory"] = lambda n, dt: torch.zeros(n, dtype=dt)  # swapped out once built
        else:  # a device-side gather source even in fp32 (the fp32 masters are on the host)
            kwargs["shard16_factory"] = lambda n, dt: torch.zeros(n, dtype=dt, device=self.device)
        return kwargs

    @property
    def _sharded(self) -> list[ShardedParamGroup]:
        """``groups`` as stage 3 builds them (ZeroEngine types them as the flat groups of stages 0-2)."""
        return cast("list[ShardedParamGroup]", self.groups)

    def _upload_is_shard16(self, fg: Any) -> bool:
        return self.offload.offload_params == "cpu" and self.compute_dtype != torch.float32 and not self.offload.delayed_param_update

    def _setup_offload(self) -> None:
        self._param_store: Optional[NvmeParamStore] = None
        if self.offload.offload_params == "nvme":  # swapped out before the host buffers are allocated
            assert self._swapper is not None
            per_unit = max((len(u.buckets) for u in self.units), default=1)
            depth = ring_depth(per_unit, self.prefetch_units)
            self._param_store = NvmeParamStore(self._swapper, self._sharded, self._pin, depth)
            self._param_store.swap_out()
        super()._setup_offload()

    def _gather_source(self, gi: int, bi: int) -> Tensor:
        if self.offload.offload_params == "none" or gi >= len(self.groups):  # frozen partitions stay on the device
            return super()._gather_source(gi, bi)
        fg = self._sharded[gi]
        b = fg.layout.buckets[bi]
        store = getattr(self, "_param_store", None)
        if store is None:
            assert fg.shard16 is not None
            return stage_to_device(fg.shard16[b.shard_offset : b.shard_offset + b.chunk], self.device)
        out = stage_to_device(store.host_chunk(gi, bi), self.device)
        store.release(gi, bi, done=copy_done(self.device))  # the slot is reused after this copy
        return out

    def _prefetch(self, upcoming: Iterable[int]) -> None:
        upcoming = list(upcoming)
        store = getattr(self, "_param_store", None)
        if store is not None and upcoming:  # read the files of these units and of as many after them
            units = [u for u in upcoming + self._beyond(upcoming) if u not in self._gathered]
            store.prefetch([key for idx in units for key in self.units[idx].buckets])
        super()._prefetch(upcoming)

    def _beyond(self, upcoming: list[int]) -> list[int]:
        """The units the prefetch after this one will ask for (recorded order; reversed in backward)."""
        from lightning_zero.zero.stage3 import _in_backward

        order: list[int] = self.order
        k = len(upcoming)
        if not _in_backward():
            pos = self._cursor + k
            return order[pos : pos + k]
        firsts = [max(i for i, u in enumerate(order) if u == idx) for idx in upcoming if idx in order]
        pos = min(firsts) if firsts else 0
        return list(reversed(order[max(0, pos - k) : pos]))

    def after_master_load(self) -> None:
        self.host_optimizer.share_from_host()  # the device share takes the loaded masters first
        self.host_optimizer.uploads.loaded()  # the upload buffers are refilled from them (_refresh_shards)
        super().after_master_load()

    def _refresh_shards(self) -> None:
        h = self.host_optimizer
        h.uploads.refill([fg.master for fg in self.groups])  # masters loaded (checkpoint): buffers are stale
        if not h.uploads.take():
            return
        for gi, fg in enumerate(self._sharded):
            src = self._upload_source(gi)
            split, n = h.splits[gi], fg.layout.shard_numel
            if h.share is not None and split < n:  # partial offload: the device share's part
                dev = h.share.source(gi, split, n)
                if self._param_store is None and fg.shard16 is not None and fg.shard16.device == dev.device:
                    fg.shard16[:split].copy_(src[:split], non_blocking=True)  # (a no-op when src is shard16)
                    fg.shard16[split:].copy_(dev)
                    continue
                src[split:].copy_(dev)  # host partitions are written from a host buffer
            if self._param_store is not None:
                self._param_store.write_group(gi, src)
            elif src is not fg.shard16:
                assert fg.shard16 is not None
                fg.shard16.copy_(src, non_blocking=True)
        h.uploads.record(h.uploads.read)

    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            stack.enter_context(super().host_state())
            if self._param_store is not None:
                stack.enter_context(self._param_store.host_state())
            yield

    @contextmanager
    def gathered_params(self, module: Any = None, writeback: bool = False) -> Generator[None, None, None]:
        with self.host_state(), super().gathered_params(module, writeback):
            yield

    def unshard_to_plain(self) -> None:
        with self.host_state():
            super().unshard_to_plain()
