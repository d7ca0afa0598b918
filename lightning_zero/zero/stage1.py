"""Stage 1: the fp32 master and optimizer states are partitioned; gradients stay full until reduced.

What is new over stage 0 (engine.py): the layout is sharded over the data-parallel ranks, each
bucket is reduce-scattered (not all-reduced) so a rank receives only its chunk, which is added in
fp32 into ``grad_shard`` (copied, the first time after a step: flat_group.py ``add_to_grad_shard``);
the full 16-bit gradient buffer is zeroed after each reduction (so several backward passes between
steps accumulate correctly); after the step the updated chunks are all-gathered back into every
rank's 16-bit parameters.

[Note: stage 1 on one rank]
With one data-parallel rank (and a group of one) the reduce-scatter is a copy into an fp32 gradient
partition the size of the whole model, which stage 0 does without: it steps its masters from the
16-bit flat gradients. So a one-rank group launches nothing and steps from ``flat_grad`` as stage 0
does (engine.py ``_master_grads``), and stage 1 on one GPU needs no more memory than stage 0 (issue
#28: 20 bytes per parameter at the step in bf16, counted in tests/offload/test_estimator_storage.py).
The values are the same: the copy, the division by one and the fp32 add it skips are exact.
"""

from __future__ import annotations

from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.zero.engine import ZeroEngine, _Pending


class Stage1Engine(ZeroEngine):
    stage = 1
    single_rank_shortcuts = True
    """Whether a one-rank group takes the one-rank shortcuts (stage 2's [Note: one data-parallel rank]
    and [Note: stage 1 on one rank]); offload engines do not: their shards live in host memory."""

    @property
    def _grads_are_sharded(self) -> bool:
        return True

    def _stage0_grads(self, gi: int) -> bool:
        """[Note: stage 1 on one rank]: this group keeps its gradient in ``flat_grad`` until the step."""
        return self.keeps_full_grad and self.single_rank_shortcuts and self.dp_size == 1 and self.comms[gi].size == 1

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
        if self._stage0_grads(gi):  # [Note: stage 1 on one rank]
            return _Pending(C.done(), lambda: None)
        fg = self.groups[gi]
        bucket = fg.bucket_view(fg.flat_grad, bi)
        return self._reduce_scatter_into_shard(gi, bi, bucket, after=bucket.zero_)

    def _master_grads(self) -> list[Tensor]:
        return [
            (fg.flat_grad if fg.shares_master else fg.flat_grad.to(fg.master.dtype)) if self._stage0_grads(gi)
            else fg.ensure_grad_shard()
            for gi, fg in enumerate(self.groups)
        ]

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
