"""The CPU step when some parameter got no gradient on any rank (zero/unused.py [Note: parameters unused
on every rank]): the compiled Adam steps the used pieces of each host shard, each with its own step
count, and leaves the others (masters, moments, the 16-bit upload) bit for bit as they were.

The step after backward (synchronous or delayed) does this from the step's plan, whatever holds the
states (host memory, NVMe chunks, bf16 compact states; the device share of partial offload steps its
pieces the same way, device_share.py). The step during backward (eager.py) steps only buckets whose
parameters all got a gradient on this rank (piece by piece once counts differ) and leaves the others
to the step, which knows the plan. int8 compact states step whole blocks (``MaskedSteps.int8`` says how,
and warns).

:class:`MaskedSteps` is a member of the host optimizer (offload/host_optimizer.py) and works on its masters,
states and upload buffers.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor

from lightning_zero.offload.compact_state import CompactStates
from lightning_zero.offload.cpu import STEP_CHUNK, AdamHyper, HostGradShard, adam_hyper, adam_update
from lightning_zero.offload.swap_state import NvmeOptimizerStore
from lightning_zero.offload.upload import Uploads
from lightning_zero.zero.unused import GroupPlan, UsedParams, planned_masters, set_group_steps

log = logging.getLogger(__name__)


class MaskedHost(Protocol):
    """What the masked step reads of the host optimizer (host_optimizer.py, which holds a MaskedSteps)."""

    optimizer: torch.optim.Optimizer
    groups: list
    pg_of: list[int]
    op: Optional[object]
    compact: Optional[CompactStates]
    opt_store: Optional[NvmeOptimizerStore]
    splits: list[int]
    step_counts: list[int]
    grads: list[HostGradShard]
    uploads: Uploads

    def host_adam_state(self, master: Tensor) -> dict: ...

    def engine_host_state(self) -> AbstractContextManager[None]: ...


class MaskedSteps:
    """The host optimizer's CPU step under a plan of zero/unused.py."""

    def __init__(self, host: MaskedHost) -> None:
        self.host = host
        self._warned_int8 = False

    # ---------------------------------------------------------------- pieces
    def step_piece(self, gi: int, grad: Tensor, out: Optional[Tensor], lo: int, hi: int, count: int,
                   hyper: AdamHyper, scale: float, threads: int) -> None:
        """Adam on ``[lo, hi)`` of group ``gi``'s host shard with step count ``count``, writing ``out``."""
        h = self.host
        if h.compact is not None:
            h.compact.range(gi, grad, out, hyper, scale, threads, count)(lo, hi)
            return
        master = h.groups[gi].master
        st = h.host_adam_state(master)
        out16 = out if out is not None and out.dtype != torch.float32 else None
        for a in range(lo, hi, STEP_CHUNK):
            b = min(hi, a + STEP_CHUNK)
            adam_update(h.op, master[a:b], grad[a:b], st["exp_avg"][a:b], st["exp_avg_sq"][a:b],
                        None if out16 is None else out16[a:b], count, hyper, scale, threads)
        if out is not None and out16 is None:
            out[lo:hi].copy_(master[lo:hi])

    def keep_piece(self, gi: int, out: Optional[Tensor], lo: int, hi: int) -> None:
        """An unstepped piece's values into ``out`` (an upload buffer may hold an older step's, or nothing yet)."""
        if out is None:
            return
        h = self.host
        src = h.compact.master_view(gi, lo, hi) if h.compact is not None else h.groups[gi].master[lo:hi]
        dst = out[lo:hi]
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    def set_step(self, gi: int, plan: GroupPlan) -> None:
        h = self.host
        st = h.optimizer.state[h.groups[gi].master]
        st["step"] = torch.full((), float(plan.steps), dtype=torch.float32)
        h.step_counts[gi] = plan.steps

    # ---------------------------------------------------------------- the step after backward
    def generic_step(self, grads: list[Tensor], coef: float, outs: list[Optional[Tensor]],
                     plans: list[Optional[GroupPlan]]) -> None:
        """Any elementwise torch optimizer on the host masters, under the plan (zero/unused.py)."""
        h = self.host
        opt = h.optimizer
        masters = [fg.master for fg in h.groups]
        g32 = []
        for m, g in zip(masters, grads):
            g = g.to(m.dtype)
            g32.append(g.mul_(coef) if coef != 1.0 else g)
        with h.engine_host_state():
            with planned_masters(opt, masters, h.pg_of, g32, plans):
                opt.step()
            set_group_steps(opt, masters, plans)
            for m, out in zip(masters, outs):
                if out is not None:
                    out.copy_(m)

    def group_step(self, gi: int, grad: Tensor, out: Optional[Tensor], hyper: AdamHyper, scale: float,
                   threads: int, plan: GroupPlan) -> None:
        """Group ``gi``'s host share under its plan: used pieces stepped with their counts, the rest kept."""
        h = self.host
        n = h.splits[gi]
        ranges = [(a, min(b, n), c) for a, b, c in plan.ranges if a < n]
        kept = [(a, min(b, n)) for a, b in plan.kept if a < n]
        store = h.opt_store
        if store is not None and not store.resident:
            store.placeholder_state(gi)

            def update(m: Tensor, g: Tensor, ea: Tensor, eas: Tensor, o16: Optional[Tensor]) -> None:
                lo = (g.data_ptr() - grad.data_ptr()) // g.element_size()  # the chunk's place in the shard
                hi = lo + g.numel()
                for a, b, c in ranges:
                    a, b = max(a, lo) - lo, min(b, hi) - lo
                    if a < b:
                        adam_update(h.op, m[a:b], g[a:b], ea[a:b], eas[a:b],
                                    None if o16 is None else o16[a:b], c, hyper, scale, threads)
                for a, b in kept:
                    a, b = max(a, lo) - lo, min(b, hi) - lo
                    if a < b and o16 is not None:
                        o16[a:b].copy_(m[a:b])

            store.adam_step(gi, grad, out, update, limit=n)
        elif h.compact is not None and h.compact.aligned:
            self.int8(gi, grad, out, hyper, scale, threads, ranges, kept, n)
        else:
            for a, b, c in ranges:
                self.step_piece(gi, grad, out, a, b, c, hyper, scale, threads)
            for a, b in kept:
                self.keep_piece(gi, out, a, b)
        self.set_step(gi, plan)

    def int8(self, gi: int, grad: Tensor, out: Optional[Tensor], hyper: AdamHyper, scale: float,
             threads: int, ranges: list[tuple[int, int, int]], kept: list[tuple[int, int]], n: int) -> None:
        """int8 states share a scale per block of INT8_BLOCK elements and are stepped in whole blocks: blocks
        holding only unused pieces are kept exactly; a block holding any used piece is stepped, with its
        first used piece's count, unused elements included (warned once: the approximation int8 states make)."""
        from lightning_zero.optim.host_states import INT8_BLOCK

        compact = self.host.compact
        assert compact is not None
        count_of: dict[int, int] = {}
        partial = False
        for a, b, c in ranges:
            for blk in range(a // INT8_BLOCK, (b - 1) // INT8_BLOCK + 1):
                partial |= blk in count_of and count_of[blk] != c
                count_of.setdefault(blk, c)
        for a, b in kept:
            partial |= any(blk in count_of for blk in range(a // INT8_BLOCK, (b - 1) // INT8_BLOCK + 1))
        blocks = (n + INT8_BLOCK - 1) // INT8_BLOCK
        runs: list[tuple[int, int, Optional[int]]] = []  # (first block, end block, count or None: kept)
        for blk in range(blocks):
            got = count_of.get(blk)
            if runs and runs[-1][2] == got and runs[-1][1] == blk:
                runs[-1] = (runs[-1][0], blk + 1, got)
            else:
                runs.append((blk, blk + 1, got))
        for first, end, count in runs:
            lo, hi = first * INT8_BLOCK, min(n, end * INT8_BLOCK)
            if count is not None:
                compact.range(gi, grad, out, hyper, scale, threads, count)(lo, hi)
            else:
                self.keep_piece(gi, out, lo, hi)
        if partial and not self._warned_int8:
            self._warned_int8 = True
            log.warning("lightning_zero: offload_state_precision='int8' steps whole blocks of %d elements: elements "
                        "of parameters unused on every rank that share a block with used ones are stepped with a zero "
                        "gradient (and pieces with different step counts share one); use 'bf16_sr' or 'fp32' states "
                        "for torch's exact behaviour.", INT8_BLOCK)

    # ---------------------------------------------------------------- the step during backward
    def run_uncovered(self, run_now: Callable[[int, int, int], None], ranges: list[tuple[int, int, int]],
                      plans: Optional[list[Optional[GroupPlan]]]) -> None:
        """The step during backward's leftovers (ranges of buckets holding a parameter without a gradient on
        this rank, deferred by the engine's ``_reduce_scatter_into_shard``), stepped under this step's plan.
        The ranges stepped during backward held only parameters used here, hence used by some rank, each
        stepped with its own count (``lagging_ranges``)."""
        if plans is None:
            for gi, lo, hi in ranges:
                run_now(gi, lo, hi)
            return
        h = self.host
        opt = h.optimizer
        threads = max(1, torch.get_num_threads() - 1)
        for gi, lo, hi in ranges:
            plan = plans[gi]
            if plan is None:
                run_now(gi, lo, hi)
                continue
            hyper = adam_hyper(opt, opt.param_groups[gi])
            assert hyper is not None, "the step during backward runs Adam only (policy.py)"
            grad = h.grads[gi].landing
            out = h.uploads.buffer(gi, h.uploads.write)
            for a, b, count in plan.ranges:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    self.step_piece(gi, grad, out, a, b, count, hyper, 1.0, threads)
            for a, b in plan.kept:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    self.keep_piece(gi, out, a, b)
        for gi, plan in enumerate(plans):
            if plan is not None:
                self.set_step(gi, plan)

    def lagging_ranges(self, gi: int, out: Optional[Tensor], hyper: AdamHyper, threads: int,
                       used: UsedParams) -> Optional[Callable[[int, int], None]]:
        """For the step during backward of a group whose parameters' step counts differ (some missed a step):
        the function stepping ``[lo, hi)`` piece by piece, each with its own count; None for other groups. Only
        buckets whose parameters all got a gradient here (hence are used) run during backward; counts and lags
        are read now, since the step's plan updates them while the worker thread may still run."""
        if not used.lagging[gi]:
            return None
        fg: Any = self.host.groups[gi]
        grad = self.host.grads[gi].landing
        counted = used.steps[gi]
        assert counted is not None, "a lagging group has had a planned step (zero/unused.py)"
        steps, lag = counted + 1, list(used.lag[gi])
        pieces = fg.layout.param_pieces_in_shard(fg.shard if fg.layout.num_shards > 1 else 0)

        def update_range(lo: int, hi: int) -> None:
            for index, _, start, n in pieces:
                a, b = max(start, lo), min(start + n, hi)
                if a < b:
                    self.step_piece(gi, grad, out, a, b, steps - lag[index], hyper, 1.0, threads)

        return update_range
