"""Stages 1-2 with optimizer offload: the updated 16-bit chunks go back to the device and are all-gathered.

What this adds to :class:`~lightning_zero.offload.engine.OffloadMixin` (the CPU step, gradients to the
host) for the flat-buffer stages: the write-back. Each bucket's chunk is uploaded from the pinned
upload buffer (or, partial offload, read from the device share) and all-gathered into every rank's
16-bit parameters, bucket by bucket as the CPU step finishes each (see [Note: uploads follow the CPU
step]).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional

import torch
from torch import Tensor
from torch.nn import Module

from lightning_zero.comm import collectives as C
from lightning_zero.offload.engine import OffloadMixin
from lightning_zero.offload.param_writes import ShardPrints
from lightning_zero.offload.params import stage_to_device
from lightning_zero.zero.engine import _Pending
from lightning_zero.zero.rebind import rebind_groups


class FlatOffloadMixin(OffloadMixin):
    """Stages 1-2: upload this rank's chunks and all-gather the full parameters, bucket by bucket as
    the CPU step finishes each (see [Note: uploads follow the CPU step])."""

    # [Note: uploads follow the CPU step]
    # A bucket's host-to-device copy and all-gather start as soon as its range is stepped, while the
    # CPU steps the next bucket (and, stepping during backward, as soon as the step thread is past
    # it), instead of after the whole step. Collectives must go in the same order on every rank, and
    # ranks may split their partitions differently (offload_ratio='auto' decides per rank), so
    # buckets are launched strictly in bucket order: a ready bucket waits for every bucket before it,
    # and the device share's buckets (stepped last, device_share.py) are launched by ``_write_back``.

    @contextmanager
    def gathered_params(self, module: Optional[Module] = None, writeback: bool = False) -> Generator[None, None, None]:
        """The 16-bit parameters are full already; ``writeback``: changes reach the host masters on exit
        (param_writes.py [Note: offloaded masters take writes outside the optimizer])."""
        yield
        if writeback:
            self.adopt_param_writes()

    def adopt_param_writes(self) -> None:
        """Merge the parameters changed since the last write-back into the masters (param_writes.py [Note:
        offloaded masters take writes outside the optimizer]): a fingerprint pass on the device, and a copy
        to the host only of the chunks that changed. Refused under the delayed update once it runs ahead."""
        now, changed = self._writes.changed()
        if self.step_policy.lagging:  # every rank refuses, whichever chunks changed (every rank calls this)
            flag = torch.tensor(float(bool(changed)), device=C.device_for(self.dp_group, self.device))
            C.all_reduce(flag, self.dp_group, op="max")
            if float(flag) > 0:
                raise RuntimeError(
                    "A parameter was changed between steps (e.g. p.data.clamp_()) under delayed_param_update, whose "
                    "masters are a step ahead of the parameters, so the change cannot be applied exactly; set "
                    "delayed_param_update=False to change weights between steps."
                )
        if not changed:
            return
        h = self.host_optimizer
        if h.opt_store is None and h.compact is None:  # resident host masters (and the device share)
            self._writes.adopt(changed, h.share)
        else:
            with self.host_state():
                self._writes.adopt(changed, h.share)
        self._writes.record(now)

    def _reduce_scatter_into_shard(self, gi: int, bi: int, bucket: Tensor, after: Optional[Any] = None) -> _Pending:
        if self.step_in_backward and not self._writes_taken:  # before the step during backward starts (eager.py)
            self._writes_taken = True
            rebind_groups(self.groups, self.param_names)  # zero/rebind.py [Note: replaced parameter storage]
            self.adopt_param_writes()
        return super()._reduce_scatter_into_shard(gi, bi, bucket, after)

    def _step_masters(self, grads: list[Tensor], coef: float) -> None:
        if not self._step_counted:
            self.adopt_param_writes()
        elif self._writes.changed()[1]:  # the step ran during backward, from the values before this change
            raise RuntimeError(
                "A parameter was changed after backward began (on_after_backward, on_before_optimizer_step) while "
                "the offloaded step ran during backward, which cannot take it; change it after the optimizer step, "
                "or set offload_step_in_backward=False."
            )
        super()._step_masters(grads, coef)

    def _setup_offload(self) -> None:
        super()._setup_offload()
        self._gather_ready: set[tuple[int, int]] = set()
        self._gather_cursor = 0
        self._gather_works: list[Any] = []
        self._writes = ShardPrints(self.groups)
        self._writes.record()  # the parameters were built from the masters
        self._writes_taken = False
        """Whether this step's writes were taken before its step during backward started."""

    def _bucket_stepped(self, gi: int, bi: int) -> None:
        self._gather_ready.add((gi, bi))
        order = self._gather_order()
        while self._gather_cursor < len(order) and order[self._gather_cursor] in self._gather_ready:
            self._launch_gather(*order[self._gather_cursor])
            self._gather_cursor += 1

    def _gather_order(self) -> list[tuple[int, int]]:
        return [(gi, bi) for gi, fg in enumerate(self.groups) for bi in range(len(fg.layout.buckets))]

    def _launch_gather(self, gi: int, bi: int) -> None:
        """Upload and all-gather bucket ``bi`` of group ``gi`` from the current upload source."""
        fg = self.groups[gi]
        b = fg.layout.buckets[bi]
        lo, hi = b.shard_offset, b.shard_offset + b.chunk
        share = self.host_optimizer.share
        on_device = share is not None and share.owns(gi, lo)
        chunk = share.source(gi, lo, hi) if share is not None and on_device else self._upload_source(gi)[lo:hi]
        dst = fg.bucket_view(fg.flat_param, bi)
        if self.dp_size == 1:
            dst.copy_(chunk, non_blocking=True)
        else:
            send = chunk.to(self.compute_dtype) if on_device else stage_to_device(chunk, self.device, self.compute_dtype)
            self._gather_works.append(C.all_gather(dst, send, self.dp_group, async_op=True))

    def after_master_load(self) -> None:
        h = self.host_optimizer
        h.share_from_host()  # the device share takes the loaded masters before the write-back sends them
        h.uploads.loaded()  # the 16-bit upload buffers come from the loaded masters
        h.uploads.refill([fg.master for fg in self.groups])
        self._write_back()

    def _write_back(self) -> None:
        uploads = self.host_optimizer.uploads
        if not uploads.take():
            return
        order = self._gather_order()
        while self._gather_cursor < len(order):  # what the step did not start (device share, NVMe, SGD...)
            self._launch_gather(*order[self._gather_cursor])
            self._gather_cursor += 1
        uploads.record(uploads.read)
        works, self._gather_works = self._gather_works, []
        self._gather_cursor, self._gather_ready = 0, set()
        for w in works:
            w.wait()
        self._writes.record()  # the parameters are the (rounded) masters: param_writes.py
        self._writes_taken = False
