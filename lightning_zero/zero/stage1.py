"""Stage 1: the fp32 master and optimizer states are partitioned; gradients stay full until reduced.

What is new over stage 0 (engine.py): the layout is sharded over the data-parallel ranks, each
bucket is reduce-scattered (not all-reduced) so a rank receives only its chunk, which is added in
fp32 into ``grad_shard`` (copied, the first time after a step: flat_group.py ``add_to_grad_shard``);
the full 16-bit gradient buffer is zeroed after each reduction (so several backward passes between
steps accumulate correctly); after the step the updated chunks are all-gathered back into every
rank's 16-bit parameters.
"""

from __future__ import annotations

from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.zero.engine import ZeroEngine, _Pending


class Stage1Engine(ZeroEngine):
    stage = 1

    @property
    def _grads_are_sharded(self) -> bool:
        return True

    def _reduce_scatter_into_shard(self, gi: int, bi: int, bucket: Tensor, after: "callable | None" = None) -> _Pending:
        fg = self.groups[gi]
        b = fg.layout.buckets[bi]
        if self.dp_size > 1:
            bucket.div_(self.dp_size)  # also for experts: shard_comm.py [Note: expert gradient scale]
        if self.comms[gi].size == 1:  # the bucket is its own (only) chunk: nothing to scatter or copy
            out, work = bucket, C.done()
        else:
            out = bucket.new_empty(b.chunk)
            work = C.reduce_scatter(out, bucket, self.comms[gi].group, async_op=True)

        def finalize() -> None:
            fg.add_to_grad_shard(bi, out)
            if after is not None:
                after()

        return _Pending(work, finalize)

    def _launch(self, gi: int, bi: int) -> _Pending:
        fg = self.groups[gi]
        bucket = fg.bucket_view(fg.flat_grad, bi)
        return self._reduce_scatter_into_shard(gi, bi, bucket, after=bucket.zero_)

    def _master_grads(self) -> list[Tensor]:
        return [fg.ensure_grad_shard() for fg in self.groups]

    def _write_back(self) -> None:
        works = []
        for fg, comm in zip(self.groups, self.comms):
            for bi in range(len(fg.layout.buckets)):
                src = fg.master_chunk(bi).to(fg.compute_dtype)
                works.append(C.all_gather(fg.bucket_view(fg.flat_param, bi), src, comm.group, async_op=True))
        for w in works:
            w.wait()

    def _zero_grads(self) -> None:
        self.used.reset()
        for fg in self.groups:
            if fg.flat_grad is not None:
                fg.flat_grad.zero_()
            fg.drop_grad_shard()
