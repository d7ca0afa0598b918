"""Stage 3 with offload: the 16-bit partitions (the gather sources) off the device too.

What this adds to :class:`~lightning_zero.offload.engine.OffloadMixin` for ZeRO-3: where each
rank's 16-bit partition lives (``offload_params``: device, pinned host memory, or NVMe files read
ahead unit by unit), how a unit's chunk reaches the device before its all-gather
(``_gather_source``), and how the CPU step's result reaches the partitions (``_refresh_shards``: in
place for pinned host partitions, uploaded otherwise, written to the swap files for NVMe).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Generator, Iterable, Optional

import torch
from torch import Tensor

from lightning_zero.offload.engine import OffloadMixin
from lightning_zero.offload.params import NvmeParamStore, copy_done, ring_depth, stage_to_device


class ParamOffloadMixin(OffloadMixin):
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

    def _upload_is_shard16(self, fg: Any) -> bool:
        return self.offload.offload_params == "cpu" and self.compute_dtype != torch.float32 and not self.offload.delayed_param_update

    def _setup_offload(self) -> None:
        self._param_store: Optional[NvmeParamStore] = None
        if self.offload.offload_params == "nvme":  # swapped out before the host buffers are allocated
            assert self._swapper is not None
            per_unit = max((len(u.buckets) for u in self.units), default=1)  # type: ignore[attr-defined]
            depth = ring_depth(per_unit, self.prefetch_units)  # type: ignore[attr-defined]
            self._param_store = NvmeParamStore(self._swapper, self.groups, self._pin, depth)
            self._param_store.swap_out()
        super()._setup_offload()

    def _gather_source(self, gi: int, bi: int) -> Tensor:
        if self.offload.offload_params == "none" or gi >= len(self.groups):  # frozen partitions stay on the device
            return super()._gather_source(gi, bi)  # type: ignore[misc]
        fg = self.groups[gi]
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
            units = [u for u in upcoming + self._beyond(upcoming) if u not in self._gathered]  # type: ignore[attr-defined]
            store.prefetch([key for idx in units for key in self.units[idx].buckets])  # type: ignore[attr-defined]
        super()._prefetch(upcoming)  # type: ignore[misc]

    def _beyond(self, upcoming: list[int]) -> list[int]:
        """The units the prefetch after this one will ask for (recorded order; reversed in backward)."""
        from lightning_zero.zero.stage3 import _in_backward

        order: list[int] = self.order  # type: ignore[attr-defined]
        k = len(upcoming)
        if not _in_backward():
            pos = self._cursor + k  # type: ignore[attr-defined]
            return order[pos : pos + k]
        firsts = [max(i for i, u in enumerate(order) if u == idx) for idx in upcoming if idx in order]
        pos = min(firsts) if firsts else 0
        return list(reversed(order[max(0, pos - k) : pos]))

    def after_master_load(self) -> None:
        self._push_loaded_share()
        self._out_valid = False
        self._upload_pending = True
        super().after_master_load()  # type: ignore[misc]

    def _refresh_shards(self) -> None:
        if not self._out_valid:  # masters were loaded (checkpoint): the upload buffers are stale
            for gi, fg in enumerate(self.groups):
                out = self._upload_buffer(gi, self._upload_from)
                if out is not None:
                    out.copy_(fg.master)
            self._out_valid = True
        if not self._upload_pending:
            return
        self._upload_pending = False
        for gi, fg in enumerate(self.groups):
            src = self._upload_source(gi)
            split, n = self._splits[gi], fg.layout.shard_numel
            if self._share is not None and split < n:  # partial offload: the device share's part
                dev = self._share.source(gi, split, n)
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
        self._record_h2d(self._upload_from)

    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            stack.enter_context(super().host_state())
            if self._param_store is not None:
                stack.enter_context(self._param_store.host_state())
            yield

    @contextmanager
    def gathered_params(self, module: Any = None, writeback: bool = False) -> Generator[None, None, None]:
        with self.host_state(), super().gathered_params(module, writeback):  # type: ignore[misc]
            yield

    def unshard_to_plain(self) -> None:
        with self.host_state():
            super().unshard_to_plain()  # type: ignore[misc]
