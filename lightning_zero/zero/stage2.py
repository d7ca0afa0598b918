"""Stage 2: gradients are partitioned too; no rank ever holds a full gradient buffer.

What is new over stage 1: instead of a persistent full gradient buffer, each bucket gets a
temporary 16-bit staging buffer when its first gradient arrives; every gradient is copied in and
the parameter's ``.grad`` is freed at once; the bucket is reduce-scattered into the fp32 shard and
its staging buffer dropped. Gradient accumulation therefore reduces every micro-batch (it cannot
keep full gradients locally: that is stage 1), and ``block_backward_sync`` is ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.parallel.dtensor import local_grad
from lightning_zero.zero.engine import _Pending
from lightning_zero.zero.stage1 import Stage1Engine


class Stage2Engine(Stage1Engine):
    stage = 2
    keeps_full_grad = False

    def _setup_grad_storage(self) -> None:
        self._staging: dict[tuple[int, int], Tensor] = {}

    def _staging_for(self, gi: int, bi: int) -> Tensor:
        key = (gi, bi)
        buf = self._staging.get(key)
        if buf is None:
            b = self.groups[gi].layout.buckets[bi]
            buf = torch.zeros(b.numel, dtype=self.compute_dtype, device=self.device)
            self._staging[key] = buf
        return buf

    def _stash_grad(self, gi: int, si: int, param: Tensor) -> None:
        fg = self.groups[gi]
        slot = fg.layout.slots[si]
        b = fg.layout.buckets[slot.bucket]
        if param.grad is not None:
            fg.param_view(si, self._staging_for(gi, slot.bucket), base=b.start).add_(local_grad(param, param.grad))
            param.grad = None

    def _launch(self, gi: int, bi: int) -> _Pending:
        buf = self._staging_for(gi, bi)

        def release() -> None:
            self._staging.pop((gi, bi), None)

        return self._reduce_scatter_into_shard(gi, bi, buf, after=release)

    def _zero_grads(self) -> None:
        for fg in self.groups:
            fg.grad_shard = None
        self._staging.clear()
