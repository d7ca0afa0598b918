"""Stage 2: gradients are partitioned too; no rank ever holds a full gradient buffer.

What is new over stage 1: instead of a persistent full gradient buffer, each bucket gets a
temporary 16-bit staging buffer when its first gradient arrives; every gradient is copied in and
the parameter's ``.grad`` is freed at once; the bucket is reduce-scattered into the fp32 shard and
its staging buffer dropped. The staging buffer is not zeroed: a parameter's first gradient is
copied into its place, a later one (a second backward before the reduction) added, and only what
no gradient wrote (parameters unused in this pass, the bucket's padding) is zeroed at the launch;
zeroing and accumulating the whole buffer cost two extra passes over every gradient (measured
~9 ms of a 150 ms GPT-1.3B step on an H100). Gradient accumulation therefore reduces every micro-batch (it cannot
keep full gradients locally: that is stage 1), and ``block_backward_sync`` is ignored.

[Note: one data-parallel rank]
With one data-parallel rank a bucket's reduce-scatter is a copy, and with one rank per gather stage 3's
all-gather is one too; on a GPT-1.3B step (one H100) the staging copy, the division by one, the
scatter copy, the zeroing of the fp32 shard and the add into it moved ~38 GB where the one-device
run's cast backward moves ~8. So when a group's ranks and the data-parallel size are both one, the
staging buffer of a bucket *is* its piece of the fp32 gradient shard: each parameter's 16-bit
gradient is copied (converted) straight into it, later ones added, and the launch only zeroes what no
gradient wrote; nothing is scattered. Stage 3 likewise points a one-rank group's full buffers at
its partition (sharded_group.py [Note: one rank aliases its partition]). Offload engines keep the
general path (``single_rank_shortcuts``): their shards live in host memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.parallel.dtensor import local_grad
from lightning_zero.zero.engine import _Pending
from lightning_zero.zero.stage1 import Stage1Engine


class Stage2Engine(Stage1Engine):
    stage = 2
    keeps_full_grad = False

    def _setup_grad_storage(self) -> None:
        self._staging: dict[tuple[int, int], Tensor] = {}
        self._unwritten: dict[tuple[int, int], set[int]] = {}
        """Per staging buffer: the slots no gradient has been copied into yet (see the module docstring)."""
        self._direct = [self._one_rank(gi) for gi in range(len(self.groups))]
        """Per flat group: gradients go straight into the fp32 shard ([Note: one data-parallel rank])."""

    def _one_rank(self, gi: int) -> bool:
        return self.single_rank_shortcuts and self.dp_size == 1 and self.comms[gi].size == 1

    def _staging_for(self, gi: int, bi: int) -> Tensor:
        key = (gi, bi)
        buf = self._staging.get(key)
        if buf is None:
            fg = self.groups[gi]
            b = fg.layout.buckets[bi]
            if self._direct[gi]:  # kept until the step: later backwards add into it
                buf = fg.ensure_grad_shard(zeroed=False)[b.shard_offset : b.shard_offset + b.chunk]
            else:
                buf = torch.empty(b.numel, dtype=self.compute_dtype, device=self.device)
            self._staging[key] = buf
            self._unwritten[key] = set(b.slots)
        return buf

    def _stash_grad(self, gi: int, si: int, param: Tensor) -> None:
        fg = self.groups[gi]
        slot = fg.layout.slots[si]
        b = fg.layout.buckets[slot.bucket]
        if param.grad is not None:
            view = fg.param_view(si, self._staging_for(gi, slot.bucket), base=b.start)
            unwritten = self._unwritten[(gi, slot.bucket)]
            if si in unwritten:
                view.copy_(local_grad(param, param.grad))
                unwritten.discard(si)
            else:
                view.add_(local_grad(param, param.grad))
            param.grad = None

    def _finish_staging(self, gi: int, bi: int) -> Tensor:
        """The bucket's staging buffer, with zeros where no gradient was written (unused parameters, padding)."""
        buf = self._staging_for(gi, bi)
        fg = self.groups[gi]
        b = fg.layout.buckets[bi]
        unwritten = self._unwritten[(gi, bi)]
        for si in unwritten:
            slot = fg.layout.slots[si]
            buf[slot.offset - b.start : slot.offset - b.start + slot.numel].zero_()
        unwritten.clear()
        if b.data_end < b.end:
            buf[b.data_end - b.start :].zero_()
        return buf

    def _launch(self, gi: int, bi: int) -> _Pending:
        buf = self._finish_staging(gi, bi)
        if self._direct[gi]:  # already in the fp32 shard ([Note: one data-parallel rank])
            return _Pending(C.done(), lambda: None)

        def release() -> None:
            self._staging.pop((gi, bi), None)
            self._unwritten.pop((gi, bi), None)

        return self._reduce_scatter_into_shard(gi, bi, buf, after=release)

    def _zero_grads(self) -> None:
        self.used.reset()
        for fg in self.groups:
            fg.drop_grad_shard()
        self._staging.clear()
        self._unwritten.clear()
