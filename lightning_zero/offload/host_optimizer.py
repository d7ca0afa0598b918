"""The host optimizer: the offloaded partition's fp32 masters, host gradients, upload buffers and CPU step.

[Note: the host optimizer]
The offload engines (engine.py, with flat.py for stages 1-2 and sharded.py for stage 3) are the ZeRO
engines with their marked steps overridden; everything that lives in host memory belongs to one object
they hold, :class:`HostOptimizer`, built once per engine from the typed offload config:

* the fp32 masters (the engine's param groups' ``master``, created in host memory by ``host_master``)
  and their optimizer states, or the members that keep them elsewhere: ``opt_store`` (NVMe chunks,
  swap_state.py), ``compact`` (bf16/int8 states, compact_state.py), ``share`` (the tail kept on the
  device, device_share.py); each is None when its feature is off;
* ``grads``: one :class:`~lightning_zero.offload.cpu.HostGradShard` per group, where the reduced
  gradients land (engine.py copies them there during backward);
* ``uploads``: the 16-bit upload buffers and the upload state (upload.py [Note: the upload state]),
  the only place that state is written;
* ``masked``: the step of groups holding a parameter no rank used (masked.py).

*When* the CPU step runs is not its concern: the step policy (policy.py: synchronous, during backward
(eager.py), or delayed (delayed.py)) is chosen once when the engine is built and calls ``cpu_step`` /
``begin_host_adam`` here. Decided in data, then executed, as in pipeline/schedule.py: which features
are on is fixed in these members at construction; the step reads them, it does not re-derive them.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor

from lightning_zero.config.offload import OffloadConfig
from lightning_zero.offload.compact_state import CompactStates
from lightning_zero.offload.cpu import (
    STEP_CHUNK, AdamHyper, HostGradShard, adam_hyper, adam_update, generic_step, host_adam_state, load_adam_op,
)
from lightning_zero.offload.device_share import DeviceShare, auto_device_numel, auto_ratio, split_at_ratio
from lightning_zero.offload.masked import MaskedSteps
from lightning_zero.offload.nvme import NvmeSwapper
from lightning_zero.offload.pinned import HostPool
from lightning_zero.offload.swap_state import NvmeOptimizerStore
from lightning_zero.offload.upload import Uploads
from lightning_zero.optim import host_states
from lightning_zero.optim.step_hooks import refuse_step_hooks
from lightning_zero.zero.unused import GroupPlan

log = logging.getLogger(__name__)

ContextFactory = Callable[[], AbstractContextManager[None]]
OnBucket = Callable[[int, int], None]
"""(param group, bucket) -> None: the bucket's 16-bit values are final in the upload source."""


class HostOptimizer:
    """What the offload engine keeps in host memory, and its CPU step (see [Note: the host optimizer])."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list, offload: OffloadConfig, host: HostPool,
                 device: torch.device, compute_dtype: torch.dtype, swapper: Optional[NvmeSwapper],
                 shard16_upload: Callable[[Any], bool], master16: Callable[[Any], Optional[Tensor]], dp_rank: int,
                 engine_host_state: ContextFactory, masters_in_optimizer: ContextFactory, pg_of: list[int],
                 device_memory: Callable[[], Optional[tuple[int, int]]]) -> None:
        """Build the members in the order host memory allows (NVMe: the masters leave host memory before
        the other host buffers arrive; compact states take the masters' memory). ``shard16_upload(fg)``:
        the step writes group ``fg``'s 16-bit partition in place (stage 3, parameters in host memory);
        ``master16(fg)``: the partition that holds a bf16 compact master (compact_state.master_in_params);
        ``engine_host_state``: the engine's ``host_state`` (stage 3 adds its parameter store);
        ``device_memory``: (total, peak) bytes of the device, for ``offload_ratio='auto'``."""
        o = offload
        self.optimizer = optimizer
        self.groups = groups
        self.offload = offload
        self.host = host
        self.device = device
        self.compute_dtype = compute_dtype
        self.pg_of = pg_of
        self.engine_host_state = engine_host_state
        """The engine's ``host_state`` (the generic step and ``auto``'s re-split run inside it)."""
        self._masters_in_optimizer = masters_in_optimizer
        self._device_memory = device_memory
        dpu = o.delayed_param_update
        self.hypers_ok = all(adam_hyper(optimizer, pg) is not None for pg in optimizer.param_groups)
        """Every param group is Adam/AdamW: the compiled CPU Adam runs (else the optimizer's own step)."""
        if self.hypers_ok:  # the compiled CPU Adam steps, not optimizer.step(): optim/step_hooks.py
            refuse_step_hooks(optimizer, f"offload_optimizer={offload.offload_optimizer!r}")
        ratio = o.offload_ratio
        if ratio != 1.0 and not self.hypers_ok:
            raise ValueError(
                f"offload_ratio={ratio!r} needs torch.optim.Adam/AdamW or lightning_zero.optim.CPUAdam (without amsgrad/"
                f"maximize): the device share is stepped by a fused Adam. Got {type(optimizer).__name__}; set "
                "offload_ratio=1."
            )
        self.auto_pending = ratio == "auto"
        """``offload_ratio='auto'``: the split is chosen after the first step (see device_share.py)."""
        self.chosen_ratio: Optional[float] = None
        fixed = 1.0 if ratio == "auto" else float(ratio)
        self.splits = [split_at_ratio(fg.layout, fixed) for fg in groups]
        """Per group: where the device share starts; ``[0, split)`` is the host share."""
        self.share: Optional[DeviceShare] = None
        if any(sp < fg.layout.shard_numel for sp, fg in zip(self.splits, groups)):
            self.share = DeviceShare(self.splits, [fg.layout.shard_numel for fg in groups], device, compute_dtype)
            self.share_from_host()
        self.opt_store: Optional[NvmeOptimizerStore] = None
        if o.offload_optimizer == "nvme":  # the masters leave host memory before other host buffers arrive
            assert swapper is not None
            self.opt_store = NvmeOptimizerStore(swapper, [fg.master for fg in groups], optimizer,
                                                o.nvme_chunk_numel, o.nvme_fraction)
            self.opt_store.swap_out_masters()
        compact = o.offload_state_precision != "fp32"
        if compact and not self.hypers_ok:
            raise ValueError(
                f"offload_state_precision={o.offload_state_precision!r} needs torch.optim.Adam/AdamW or "
                f"lightning_zero.optim.CPUAdam (without amsgrad/maximize); got {type(optimizer).__name__}."
            )
        self.compact: Optional[CompactStates] = None
        if compact:  # the masters move into compact states before other host buffers (compact_state.py)
            self.compact = CompactStates(groups, host_states.check_precision(o.offload_state_precision), host,
                                         [master16(fg) for fg in groups], optimizer, dp_rank)
        self.step_counts = [0] * len(groups)
        """The Adam step count of each group's last step (the device share steps with the host's count)."""
        self.grads = [HostGradShard(sp, compute_dtype, host.empty, spares=int(dpu)) for sp in self.splits]
        if dpu and not self.hypers_ok:
            raise ValueError(
                "delayed_param_update needs torch.optim.Adam/AdamW or lightning_zero.optim.CPUAdam (without amsgrad/"
                f"maximize); got {type(optimizer).__name__}. Set delayed_param_update=False."
            )
        self.op = load_adam_op() if self.hypers_ok else None
        buffers: list[list[Tensor]] = [[] for _ in groups]
        need_upload = compute_dtype != torch.float32 or o.offload_optimizer == "nvme" or dpu or compact
        for gi, fg in enumerate(groups):
            if need_upload and not shard16_upload(fg):
                buffers[gi] = [host.empty(fg.layout.shard_numel, compute_dtype) for _ in range(1 + dpu)]

        def fallback(gi: int) -> Optional[Tensor]:
            fg = groups[gi]
            return fg.shard16 if shard16_upload(fg) else None

        self.uploads = Uploads(buffers, fallback, device)
        self.masked = MaskedSteps(self)

    # ---------------------------------------------------------------- the CPU step
    def cpu_step(self, grads: list[Tensor], coef: float, up: int, hypers: Optional[list[Optional[AdamHyper]]] = None,
                 on_bucket: Optional[OnBucket] = None, plans: Optional[list[Optional[GroupPlan]]] = None) -> None:
        """The host share's step after backward, writing upload buffer ``up``. ``on_bucket`` (the training
        thread, synchronous step): bucket by bucket, each bucket's upload started as soon as it is stepped;
        never from the delayed update's thread, which must not issue collectives. ``plans``: the step's plan
        when some parameter was unused on every rank (zero/unused.py; masked.py steps those groups)."""
        opt = self.optimizer
        hypers = hypers or [adam_hyper(opt, pg) for pg in opt.param_groups]
        outs = [self.uploads.buffer(gi, up) for gi in range(len(self.groups))]
        if not all(h is not None for h in hypers) and plans is not None:
            self.masked.generic_step(grads, coef, outs, plans)
            return
        if not all(h is not None for h in hypers):
            with self.engine_host_state(), self._masters_in_optimizer():
                generic_step(opt, [fg.master for fg in self.groups], grads, coef)
                for fg, out in zip(self.groups, outs):
                    if out is not None:
                        out.copy_(fg.master)
            return
        scale = 1.0 / coef
        threads = torch.get_num_threads()
        for gi, (fg, grad, out, hyper) in enumerate(zip(self.groups, grads, outs, hypers)):
            assert hyper is not None
            plan = plans[gi] if plans is not None else None
            if plan is not None:  # some parameter unused on every rank
                self.masked.group_step(gi, grad, out, hyper, scale, threads, plan)
                for bi, b in enumerate(fg.layout.buckets):
                    if on_bucket is not None and b.shard_offset < self.splits[gi]:
                        on_bucket(gi, bi)
                continue
            store = self.opt_store
            if store is not None and not store.resident:
                st = store.placeholder_state(gi)
                st["step"] += 1
                step = int(st["step"].item())

                def update(m: Tensor, g: Tensor, ea: Tensor, eas: Tensor, o16: Optional[Tensor],
                           step: int = step, hyper: AdamHyper = hyper) -> None:
                    adam_update(self.op, m, g, ea, eas, o16, step, hyper, scale, threads)

                self.step_counts[gi] = step
                store.adam_step(gi, grad, out, update, limit=self.splits[gi])
                continue
            update_range = self.begin_host_adam(gi, grad, out, hyper, scale, threads)
            if self.compact is not None and self.compact.aligned:  # int8 blocks: aligned chunks, uploads after the step
                n = self.splits[gi]
                for lo in range(0, n, STEP_CHUNK):  # STEP_CHUNK is a multiple of the block size
                    update_range(lo, min(n, lo + STEP_CHUNK))
                continue
            for bi, b in enumerate(fg.layout.buckets):
                if b.shard_offset >= self.splits[gi]:
                    break  # the device share (device_share.py)
                end = b.shard_offset + b.chunk
                for lo in range(b.shard_offset, end, STEP_CHUNK):  # see STEP_CHUNK
                    update_range(lo, min(end, lo + STEP_CHUNK))
                if out is not None and out.dtype == torch.float32 and self.compact is None:
                    out[b.shard_offset : end].copy_(fg.master[b.shard_offset : end])
                if on_bucket is not None:
                    on_bucket(gi, bi)

    def begin_host_adam(self, gi: int, grad: Tensor, out: Optional[Tensor], hyper: AdamHyper, scale: float,
                        threads: int) -> Callable[[int, int], None]:
        """Count one Adam step for group ``gi``'s host-resident master and return the function that
        updates a range ``[lo, hi)`` of it (writing a 16-bit ``out`` in the same pass). The step after
        backward calls it chunk by chunk; the step during backward (eager.py) bucket by bucket."""
        master = self.groups[gi].master
        if self.compact is not None:
            step = self.compact.step_count(master)
            self.step_counts[gi] = step
            return self.compact.range(gi, grad, out, hyper, scale, threads, step)
        st = self.host_adam_state(master)
        st["step"] += 1
        step = int(st["step"].item())
        self.step_counts[gi] = step
        out16 = out if out is not None and out.dtype != torch.float32 else None

        def update_range(lo: int, hi: int) -> None:
            adam_update(self.op, master[lo:hi], grad[lo:hi], st["exp_avg"][lo:hi], st["exp_avg_sq"][lo:hi],
                        None if out16 is None else out16[lo:hi], step, hyper, scale, threads)

        return update_range

    def host_adam_state(self, master: Tensor) -> dict:
        """The master's Adam moments, created in the host pool (see pinned.py [Note: forked workers])."""
        st = self.optimizer.state[master]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = self.host.zeros(master.numel(), torch.float32, pin=False)
            st["exp_avg_sq"] = self.host.zeros(master.numel(), torch.float32, pin=False)
        return host_adam_state(self.optimizer, master)  # moves a loaded "step" to the host

    def zero_grads(self) -> None:
        for hg in self.grads:
            hg.reset()
        if self.share is not None:
            self.share.zero_grads()

    # ---------------------------------------------------------------- the device share (device_share.py)
    def host_trio(self, gi: int) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """Group ``gi``'s full-size host master and Adam moments (None before the first step)."""
        master = self.groups[gi].master
        st = self.optimizer.state.get(master, {})
        return master, st.get("exp_avg"), st.get("exp_avg_sq")

    def share_from_host(self) -> None:
        """The device shares take their values from the host masters and states (setup, ``auto``, a
        load: before the write-back sends its values, the mirror's own push comes only when ``host_state``
        ends)."""
        if self.share is not None:
            for gi in range(len(self.groups)):
                self.share.push(gi, *self.host_trio(gi))

    def step_device_share(self, coef: float, plans: Optional[list[Optional[GroupPlan]]]) -> None:
        """The device share's Adam step, after the host share's (same count and hyper-parameters)."""
        if self.share is not None:
            for gi, pg in enumerate(self.optimizer.param_groups):
                hyper = adam_hyper(self.optimizer, pg)
                assert hyper is not None, "offload_ratio < 1 needs Adam (checked at setup)"
                plan = plans[gi] if plans is not None else None  # zero/unused.py
                if plan is not None:
                    self.share.step_pieces(gi, plan.ranges, plan.steps, hyper, 1.0 / coef)
                else:
                    self.share.step(gi, self.step_counts[gi], hyper, 1.0 / coef)
        if self.auto_pending:
            self.auto_pending = False
            self._choose_auto_split()

    def _choose_auto_split(self) -> None:
        """``offload_ratio='auto'`` after the first (fully offloaded) step: move the partition's tail
        that fits the device there (device_share.py [Note: partial offload])."""
        mem = self._device_memory()
        if mem is None:
            return
        numels = [fg.layout.shard_numel for fg in self.groups]
        fits = auto_device_numel(mem[0], mem[1], self.compute_dtype)
        ratio = auto_ratio(numels, fits)
        splits = [split_at_ratio(fg.layout, ratio, round_host_up=True) for fg in self.groups]
        log.info("lightning_zero: offload_ratio='auto' keeps %.3f of the optimizer partition on the host "
                 "(%.2f GiB peak of %.2f GiB; %d of %d elements move to the device)", ratio, mem[1] / 2**30,
                 mem[0] / 2**30, sum(n - sp for n, sp in zip(numels, splits)), sum(numels))
        self.chosen_ratio = ratio
        if splits == self.splits:
            return
        with self.engine_host_state():  # NVMe: the states the device share starts from must be resident
            self.splits = splits
            self.share = DeviceShare(splits, numels, self.device, self.compute_dtype)
            self.share_from_host()

    # ---------------------------------------------------------------- states off the device
    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        """Masters and optimizer states resident and current inside the block, in torch's fp32 layout."""
        with ExitStack() as stack:
            if self.opt_store is not None:
                stack.enter_context(self.opt_store.host_state())
            if self.compact is not None:  # torch's fp32 layout inside (compact_state.py)
                stack.enter_context(self.compact.host_state())
            if self.share is not None:  # entered last: pulls into, and pushes from, resident host tensors
                stack.enter_context(self.share.mirrored(self.host_trio))
            yield

    # ---------------------------------------------------------------- the synchronous step
    def step_now(self, grads: list[Tensor], coef: float, plans: Optional[list[Optional[GroupPlan]]],
                 on_bucket: OnBucket) -> None:
        """Step now, in the training thread, into upload buffer ``write`` (once its last upload is done),
        bucket by bucket with ``on_bucket``; then the device share; the result is PENDING (upload.py)."""
        uploads = self.uploads
        index = uploads.write
        uploads.wait(index)
        uploads.begin(index)
        self.cpu_step(grads, coef, index, on_bucket=on_bucket, plans=plans)
        self.step_device_share(coef, plans)
        uploads.stepped(index)
