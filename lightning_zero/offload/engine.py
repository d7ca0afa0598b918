"""Offload mixed into the ZeRO engines: what changes when masters, states and partitions leave the device.

:class:`OffloadMixin` (here) is what every stage shares: host masters, gradients to the host, the CPU
step. flat.py (stages 1-2) and sharded.py (stage 3) add the write-back; engines.py names the three
engines. The step during backward (eager.py), the delayed update (delayed.py) and partial offload
(device_share.py) are the mixin's parts in files of their own. They override only the engine's
marked steps, in the order a step runs them:

1. construction (``_group_kwargs``): masters in host memory (NVMe: swapped out once built); stage 3's
   gather source ``shard16`` on the device, in pinned host memory, or in swap files;
2. ``_reduce_scatter_into_shard``: each reduced gradient chunk is copied device-to-host into the
   pinned landing buffer as soon as its reduce-scatter finishes (CUDA: on a side stream that waits
   for the collective, overlapping the rest of backward); its squared norm is summed on the device;
3. ``global_grad_norm_sq`` / ``_master_grads``: the norm from the device sums (one micro-batch) or
   from the host gradients (accumulated);
4. ``_step_masters``: the CPU step (cpu.py; NVMe: swap_state.py's chunk pipeline), writing the
   16-bit result into the pinned upload buffer; with the delayed update it runs in a background
   thread and the upload of the *previous* step's result happens instead; when the strategy sets
   ``step_in_backward`` it already ran range by range during step 2 (eager.py) and is only awaited;
   with ``offload_ratio`` < 1 the device share then steps on the device (device_share.py);
5. ``_write_back`` (stages 1-2) / ``_refresh_shards`` (stage 3): host-to-device upload, then the
   stage's own all-gather (1-2) or nothing more (3: the next forward gathers unit by unit, copying
   each unit's chunk to the device first through ``_gather_source``).

[Note: delayed parameter update] is in delayed.py.

[Note: one code path on CPU]
On a CPU-only machine "device" and "host" are both CPU memory, but every buffer above is still a
separate allocation and every copy still happens, so CI runs the offload code paths (and NVMe
swapping fully) exactly as a GPU machine does; only streams, events and pinning are skipped.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.offload import estimator as est
from lightning_zero.offload.cpu import (
    STEP_CHUNK, AdamHyper, HostGradShard, adam_hyper, adam_update, generic_step, host_adam_state, load_adam_op,
    sum_of_squares,
)
from lightning_zero.offload.compact_state import CompactStateMixin
from lightning_zero.offload.delayed import DelayedUpdateMixin
from lightning_zero.offload.eager import EagerStep, StepInBackwardMixin
from lightning_zero.offload.masked import MaskedStepMixin
from lightning_zero.offload.nvme import NvmeSwapper, SwapDir, SwapFileError, check_nvme_path
from lightning_zero.offload.device_share import DeviceShare, PartialOffloadMixin, split_at_ratio
from lightning_zero.config.offload import OffloadConfig
from lightning_zero.offload.settings import OffloadHost
from lightning_zero.offload.pinned import HostPool, available_host_bytes, can_pin, check_host_memory
from lightning_zero.offload.swap_state import NvmeOptimizerStore
from lightning_zero.optim import host_states
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.zero.engine import _Pending, squared_norm

log = logging.getLogger(__name__)


def note_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Record, as ``optimizer.step()`` would, that ``optimizer`` stepped: bookkeeping only.

    [Note: the LR scheduler sees the CPU step]
    The CPU step updates the masters with the compiled Adam (after or during backward, or in the
    delayed-update thread), not through ``optimizer.step()``. torch's LR schedulers wrap
    ``optimizer.step`` when they are built, the wrapper sets ``optimizer._opt_called``, and a
    scheduler's first ``step()`` without it warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()` ... PyTorch skipping the first value of the learning rate schedule": wrong
    here (the CPU step read this step's learning rate from ``param_groups`` before Lightning stepped
    the scheduler, torch's order), and printed on every offload run. We set the flag the wrapper would
    have set (torch >= 2.4 reads this attribute; nothing else does); optimizer step hooks are not run,
    as they are not for a step that torch's own optimizer never performed.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


class OffloadMixin(MaskedStepMixin, StepInBackwardMixin, DelayedUpdateMixin, PartialOffloadMixin, CompactStateMixin):
    """Optimizer offload for stages 1-3 (see the module docstring). Put before the engine class; the
    step during backward (eager.py), the delayed update (delayed.py), partial offload
    (device_share.py) and compact host states (compact_state.py) are its parts in files of their own."""

    single_rank_shortcuts = False
    """Shards live in host memory: no shortcut of stage2.py's [Note: one data-parallel rank]."""

    # attributes of ZeroEngine this mixin relies on (for readers and type checkers)
    groups: list
    optimizer: torch.optim.Optimizer
    device: torch.device
    compute_dtype: torch.dtype
    dp_group: Optional[C.ProcessGroup]
    dp_size: int
    stage: int

    def __init__(self, optimizer: torch.optim.Optimizer, dp_group: Optional[C.ProcessGroup],
                 compute_dtype: torch.dtype, device: torch.device, bucket_numel: int, *args: Any,
                 offload: OffloadConfig, offload_host: OffloadHost, **kwargs: Any) -> None:
        self.offload = offload
        self.offload_host = offload_host
        self._pin = can_pin(device, offload.pin_memory)
        self.host = HostPool(pin=self._pin)
        weakref.finalize(self, self.host.release)
        self._accumulating = offload_host.accumulate
        self._check_resources(optimizer, dp_group, compute_dtype, bucket_numel)
        self._swapper: Optional[NvmeSwapper] = None
        if offload.uses_nvme:
            swap_dir = SwapDir(Path(str(offload.nvme_path)).expanduser(), offload_host.global_rank)
            self._swapper = NvmeSwapper(swap_dir, offload.nvme_io_threads)
            self._finalizer = weakref.finalize(self, self._swapper.close)
        self._swap_closed = False
        super().__init__(optimizer, dp_group, compute_dtype, device, bucket_numel, *args, **kwargs)  # type: ignore[call-arg]
        self._setup_offload()

    # ---------------------------------------------------------------- construction
    def _workload(self, optimizer: torch.optim.Optimizer, dp_size: int, compute_dtype: torch.dtype,
                  bucket_numel: int) -> est.Workload:
        seen: set[int] = set()
        total = 0
        for pg in optimizer.param_groups:
            for p in pg["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    total += local_tensor(p).numel()  # a DTensor's TP shard is what this rank offloads
        return est.Workload(
            total, gpus_per_node=dp_size, compute_bytes=torch.empty((), dtype=compute_dtype).element_size(),
            bucket_numel=bucket_numel, delayed_update=self.offload.delayed_param_update,
            accumulate=self._accumulating, nvme_chunk_numel=self._chunk_numel(), nvme_fraction=self.offload.nvme_fraction,
            state_bytes=host_states.bytes_per_param(self.offload.offload_state_precision),  # type: ignore[arg-type]
            master_in_params=self._compact_master_in_params(compute_dtype),
        )

    def _chunk_numel(self) -> int:
        return self.offload.nvme_chunk_numel

    def _check_resources(self, optimizer: torch.optim.Optimizer, dp_group: Optional[C.ProcessGroup],
                         compute_dtype: torch.dtype, bucket_numel: int) -> None:
        """Host memory and NVMe space, before anything is allocated (the estimator's figures)."""
        o, per_node = self.offload, self.offload_host.ranks_per_node
        setting = est.Setting(self.stage, o.offload_optimizer, o.offload_params)
        w = self._workload(optimizer, C.world_size(dp_group), compute_dtype, bucket_numel)
        host = est.offload_host_bytes_per_rank(setting, w)
        if o.offload_optimizer == "nvme":  # the masters are built in host memory once, then swapped out
            host = max(host, est.nvme_build_peak_bytes_per_rank(setting, w))
        advice = (
            "Set offload_optimizer='nvme' (and offload_params='nvme') with nvme_path on a local disk, set "
            "pin_memory=False if the host is short of page-lockable memory, or train on more ranks/nodes."
            if o.offload_optimizer == "cpu" or o.offload_params == "cpu" else
            "Lower nvme_chunk_mb, or train on more ranks/nodes."
        )
        what = (f"offload_optimizer={o.offload_optimizer!r}, offload_params={o.offload_params!r}: fp32 masters, optimizer "
                "states and gradient/parameter buffers for this rank's partition")
        check_host_memory(int(host), per_node, what, advice, available=available_host_bytes())
        if o.uses_nvme:
            need = int(est.nvme_bytes_per_rank(setting, w) * per_node)
            check_nvme_path(o.nvme_path, need, f"offload_optimizer={o.offload_optimizer!r}, offload_params={o.offload_params!r}, "
                            f"{per_node} rank(s) on this node")

    def _host_master(self, numel: int, dtype: torch.dtype) -> Tensor:
        # fp32 training without an upload buffer uploads straight from the masters: pin them then
        if self.offload.offload_optimizer == "nvme":  # swapped out once built: resizable storage (swap_state.make_placeholder)
            return torch.zeros(numel, dtype=dtype)
        if self.offload.offload_state_precision != "fp32":  # its memory becomes the compact state's (compact_state.py)
            return self.host.zeros(numel, dtype, pin=False)
        pinned = self.compute_dtype == torch.float32 and not self.offload.delayed_param_update
        return self.host.zeros(numel, dtype, pin=pinned and self._pin)

    def _group_kwargs(self) -> dict[str, object]:
        return {"master_factory": self._host_master}

    def _setup_offload(self) -> None:
        o = self.offload
        dpu = o.delayed_param_update
        self._hypers_ok = all(adam_hyper(self.optimizer, pg) is not None for pg in self.optimizer.param_groups)
        ratio = o.offload_ratio
        if ratio != 1.0 and not self._hypers_ok:
            raise ValueError(
                f"offload_ratio={ratio!r} needs torch.optim.Adam/AdamW or lightning_zero.optim.CPUAdam (without amsgrad/"
                f"maximize): the device share is stepped by a fused Adam. Got {type(self.optimizer).__name__}; set "
                "offload_ratio=1."
            )
        self._auto_pending = ratio == "auto"
        """``offload_ratio='auto'``: the split is chosen after the first step (see device_share.py)."""
        fixed = 1.0 if ratio == "auto" else float(ratio)
        self._splits = [split_at_ratio(fg.layout, fixed) for fg in self.groups]
        """Per group: where the device share starts; ``[0, split)`` is the host share."""
        self._share: Optional[DeviceShare] = None
        if any(sp < fg.layout.shard_numel for sp, fg in zip(self._splits, self.groups)):
            self._share = DeviceShare(self._splits, [fg.layout.shard_numel for fg in self.groups], self.device,
                                      self.compute_dtype)
            self._share_from_host()
        self._opt_store: Optional[NvmeOptimizerStore] = None
        if o.offload_optimizer == "nvme":  # the masters leave host memory before other host buffers arrive
            assert self._swapper is not None
            self._opt_store = NvmeOptimizerStore(self._swapper, [fg.master for fg in self.groups], self.optimizer,
                                                 self._chunk_numel(), self.offload.nvme_fraction)
            self._opt_store.swap_out_masters()
        compact = o.offload_state_precision != "fp32"
        if compact and not self._hypers_ok:
            raise ValueError(
                f"offload_state_precision={o.offload_state_precision!r} needs torch.optim.Adam/AdamW or "
                f"lightning_zero.optim.CPUAdam (without amsgrad/maximize); got {type(self.optimizer).__name__}."
            )
        self._setup_compact()  # compact_state.py: the masters move into compact states before other host buffers
        self._step_counts = [0] * len(self.groups)
        """The Adam step count of each group's last step (the device share steps with the host's count)."""
        self._grads = [HostGradShard(sp, self.compute_dtype, self.host.empty, spares=int(dpu)) for sp in self._splits]
        if dpu and not self._hypers_ok:
            raise ValueError(
                "delayed_param_update needs torch.optim.Adam/AdamW or lightning_zero.optim.CPUAdam (without amsgrad/"
                f"maximize); got {type(self.optimizer).__name__}. Set delayed_param_update=False."
            )
        self._op = load_adam_op() if self._hypers_ok else None
        self._uploads: list[list[Tensor]] = [[] for _ in self.groups]
        need_upload = self.compute_dtype != torch.float32 or o.offload_optimizer == "nvme" or dpu or compact
        for gi, fg in enumerate(self.groups):
            if need_upload and not self._upload_is_shard16(fg):
                self._uploads[gi] = [self.host.empty(fg.layout.shard_numel, self.compute_dtype) for _ in range(1 + dpu)]
        self._up = 0
        """Index of the upload buffer the next (synchronous or background) step writes."""
        self._upload_pending = False
        self._upload_from = 0
        self._out_valid = True
        self._backwards = 0
        self._dev_sq: Optional[Tensor] = None
        self._steps = 0
        self._d2h = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._h2d_events: dict[int, Any] = {}
        self._dpu_pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(1, "lz-dpu") if dpu else None
        self._dpu_future: Optional[Future] = None
        self._dpu_up = 0
        self.step_in_backward = False
        """Set by the strategy before each step: run this step's CPU update during backward (eager.py)."""
        self._eager_possible = (o.offload_step_in_backward and o.offload_optimizer == "cpu" and not dpu and self._hypers_ok
                                and not self._compact_aligned)
        self._eager: Optional[EagerStep] = None
        self._eager_pool: Optional[ThreadPoolExecutor] = None
        self.eager_steps = 0
        """Steps that ran during backward (tests and benchmarks read it)."""

    def _upload_is_shard16(self, fg: Any) -> bool:
        """Stage 3 with parameters in host memory: the CPU step writes the partitions in place."""
        return False


    # ---------------------------------------------------------------- backward: gradients to the host
    def _reduce_scatter_into_shard(self, gi: int, bi: int, bucket: Tensor, after: Optional[Any] = None) -> _Pending:
        if any(hg.fresh for hg in self._grads):  # a new micro-batch: keep the previous one (accumulation)
            self._sync_d2h()
            for hg in self._grads:
                hg.fold()
        eager = self._eager_for_this_backward()
        if eager is not None and self._bw.missing[(gi, bi)] > 0:  # type: ignore[attr-defined]
            eager = None  # a parameter without a gradient here: stepped at the step, under its plan (masked.py)
        fg = self.groups[gi]
        b = fg.layout.buckets[bi]
        lo, hi = b.shard_offset, b.shard_offset + b.chunk
        bucket.div_(self.dp_size)
        out = bucket.new_empty(b.chunk)
        work = C.reduce_scatter(out, bucket, self.dp_group, async_op=True)
        if self._share is not None and self._share.owns(gi, lo):  # partial offload: this chunk stays here
            share = self._share

            def finalize_on_device() -> None:
                share.land(gi, lo, out)
                sq = self._chunk_sq(gi, lo, out)
                self._dev_sq = sq if self._dev_sq is None else self._dev_sq + sq
                if after is not None:
                    after()

            return _Pending(work, finalize_on_device)
        dst = self._grads[gi].landing[lo:hi]
        if self._d2h is not None:  # the side stream waits for the collective, then copies; backward goes on
            main = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_stream(main)  # one rank: the "collective" was a copy on the main stream
                work.wait()
                dst.copy_(out, non_blocking=True)
            out.record_stream(self._d2h)
            if eager is not None:  # step this range on the host as soon as the copy is done
                landed = torch.cuda.Event()
                landed.record(self._d2h)
                eager.submit(gi, lo, hi, landed)

        def finalize() -> None:
            if self._d2h is None:
                dst.copy_(out)  # the device-to-host copy (a separate host buffer on CPU too)
                if eager is not None:
                    eager.submit(gi, lo, hi)
            sq = self._chunk_sq(gi, lo, out)
            self._dev_sq = sq if self._dev_sq is None else self._dev_sq + sq
            if after is not None:
                after()

        return _Pending(work, finalize)


    def _sync_d2h(self) -> None:
        if self._d2h is not None:
            self._d2h.synchronize()

    def post_backward(self) -> None:
        syncing = self._syncing and not self._nothing_to_reduce()  # type: ignore[attr-defined]
        super().post_backward()  # type: ignore[misc]
        if syncing:
            for hg in self._grads:
                hg.fresh = True
            self._backwards += 1

    def _master_grads(self) -> list[Tensor]:
        self._sync_d2h()
        return [hg.value() for hg in self._grads]

    def _chunk_sq(self, gi: int, lo: int, chunk: Tensor) -> Tensor:
        """Squared norm of a gradient chunk starting at shard offset ``lo`` of group ``gi``, its replicated
        TP elements weighted by 1/tp (zero/engine.py [Note: gradient norm under tensor parallelism])."""
        sq = squared_norm(chunk)
        tp = self.tp_size  # type: ignore[attr-defined]
        if tp > 1:
            hi = lo + chunk.numel()
            for a, b in self._replicated[gi]:  # type: ignore[attr-defined]
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    sq = sq - (1.0 - 1.0 / tp) * squared_norm(chunk[a - lo : b - lo])
        return sq

    def global_grad_norm_sq(self, grads: Any) -> Tensor:
        if self._backwards == 1 and self._dev_sq is not None:
            sq = self._dev_sq.float().clone()  # summed on the device as the chunks arrived (reduced in place next)
        else:
            grads = list(grads)
            total = sum_of_squares(grads) + (self._share.grad_sq(self._chunk_sq) if self._share is not None else 0.0)
            tp = self.tp_size  # type: ignore[attr-defined]
            if tp > 1:  # replicated TP elements counted once (zero/engine.py [Note: gradient norm under tensor parallelism])
                total -= (1.0 - 1.0 / tp) * sum_of_squares([grads[gi][a:b] for gi in range(len(grads))
                                                            for a, b in self._replicated[gi]])  # type: ignore[attr-defined]
            sq = torch.tensor(total, dtype=torch.float32, device=self.device)
        return self._reduce_grad_sq(sq)  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._eager is not None:
            raise RuntimeError(
                "optimizer.zero_grad() between backward and step: with offload_step_in_backward the update already "
                "ran during backward. Set ZeroStrategy(offload_step_in_backward=False) for this training loop."
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def _zero_grads(self) -> None:
        super()._zero_grads()  # type: ignore[misc]
        for hg in self._grads:
            hg.reset()
        if self._share is not None:
            self._share.zero_grads()
        self._backwards = 0
        self._dev_sq = None

    # ---------------------------------------------------------------- the CPU step
    def _step_masters(self, grads: list[Tensor], coef: float) -> None:
        note_optimizer_step(self.optimizer)  # see [Note: the LR scheduler sees the CPU step]
        if self._eager is not None:
            self._finish_eager(coef)
            self._step_device_share(coef)
            return
        self._steps += 1
        if self._dpu_pool is None or self._steps <= self.offload.delayed_param_update_warmup:
            self._wait_h2d(self._up)
            self._upload_from = self._up
            self._cpu_step(grads, coef, self._up, pipelined=True, plans=self._plans)
            self._step_device_share(coef)
            self._upload_from, self._upload_pending = self._up, True
            return
        self._step_delayed(grads, coef)

    def _cpu_step(self, grads: list[Tensor], coef: float, up: int,
                  hypers: Optional[list[Optional[AdamHyper]]] = None, pipelined: bool = False,
                  plans: Optional[list] = None) -> None:
        """The host share's step after backward. ``pipelined`` (the training thread, synchronous step):
        bucket by bucket, each bucket's upload started as soon as it is stepped (``_bucket_stepped``);
        never from the delayed update's thread, which must not issue collectives. ``plans``: the step's
        plan when some parameter was unused on every rank (zero/unused.py; masked.py steps those groups)."""
        opt = self.optimizer
        hypers = hypers or [adam_hyper(opt, pg) for pg in opt.param_groups]
        outs = [self._upload_buffer(gi, up) for gi in range(len(self.groups))]
        if not all(h is not None for h in hypers) and plans is not None:
            self._masked_generic_step(grads, coef, outs, plans)
            self._out_valid = True
            return
        if not all(h is not None for h in hypers):
            with self.host_state(), self.masters_in_optimizer():  # type: ignore[attr-defined]
                generic_step(opt, [fg.master for fg in self.groups], grads, coef)
                for fg, out in zip(self.groups, outs):
                    if out is not None:
                        out.copy_(fg.master)
            self._out_valid = True
            return
        scale = 1.0 / coef
        threads = torch.get_num_threads()
        for gi, (fg, grad, out, hyper) in enumerate(zip(self.groups, grads, outs, hypers)):
            assert hyper is not None
            if plans is not None and plans[gi] is not None:  # some parameter unused on every rank
                self._masked_group_step(gi, grad, out, hyper, scale, threads, plans[gi])
                for bi, b in enumerate(fg.layout.buckets):
                    if pipelined and b.shard_offset < self._splits[gi]:
                        self._bucket_stepped(gi, bi)
                continue
            store = self._opt_store
            if store is not None and not store.resident:
                st = store.placeholder_state(gi)
                st["step"] += 1
                step = int(st["step"].item())

                def update(m: Tensor, g: Tensor, ea: Tensor, eas: Tensor, o16: Optional[Tensor],
                           step: int = step, hyper: AdamHyper = hyper) -> None:
                    adam_update(self._op, m, g, ea, eas, o16, step, hyper, scale, threads)

                self._step_counts[gi] = step
                store.adam_step(gi, grad, out, update, limit=self._splits[gi])
                continue
            update_range = self._begin_host_adam(gi, grad, out, hyper, scale, threads)
            if self._compact_aligned:  # int8 blocks: aligned chunks, uploads after the step
                n = self._splits[gi]
                for lo in range(0, n, STEP_CHUNK):  # STEP_CHUNK is a multiple of the block size
                    update_range(lo, min(n, lo + STEP_CHUNK))
                continue
            for bi, b in enumerate(fg.layout.buckets):
                if b.shard_offset >= self._splits[gi]:
                    break  # the device share (device_share.py)
                end = b.shard_offset + b.chunk
                for lo in range(b.shard_offset, end, STEP_CHUNK):  # see STEP_CHUNK
                    update_range(lo, min(end, lo + STEP_CHUNK))
                if out is not None and out.dtype == torch.float32 and self._compact is None:
                    out[b.shard_offset : end].copy_(fg.master[b.shard_offset : end])
                if pipelined:
                    self._bucket_stepped(gi, bi)
        self._out_valid = True

    def _bucket_stepped(self, gi: int, bi: int) -> None:
        """Bucket ``bi`` of group ``gi`` has its final 16-bit values in the upload source (stages 1-2
        start its upload and all-gather here; stage 3 uploads after the step)."""

    def _begin_host_adam(self, gi: int, grad: Tensor, out: Optional[Tensor], hyper: AdamHyper, scale: float,
                         threads: int) -> Callable[[int, int], None]:
        """Count one Adam step for group ``gi``'s host-resident master and return the function that
        updates a range ``[lo, hi)`` of it (writing a 16-bit ``out`` in the same pass). The step after
        backward calls it chunk by chunk; the step during backward (eager.py) bucket by bucket."""
        master = self.groups[gi].master
        if self._compact is not None:
            step = self._compact_step_count(master)
            self._step_counts[gi] = step
            return self._compact_range(gi, grad, out, hyper, scale, threads, step)
        st = self._host_adam_state(master)
        st["step"] += 1
        step = int(st["step"].item())
        self._step_counts[gi] = step
        out16 = out if out is not None and out.dtype != torch.float32 else None

        def update_range(lo: int, hi: int) -> None:
            adam_update(self._op, master[lo:hi], grad[lo:hi], st["exp_avg"][lo:hi], st["exp_avg_sq"][lo:hi],
                        None if out16 is None else out16[lo:hi], step, hyper, scale, threads)

        return update_range

    def _host_adam_state(self, master: Tensor) -> dict:
        """The master's Adam moments, created in the host pool (see pinned.py [Note: forked workers])."""
        st = self.optimizer.state[master]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = self.host.zeros(master.numel(), torch.float32, pin=False)
            st["exp_avg_sq"] = self.host.zeros(master.numel(), torch.float32, pin=False)
        return host_adam_state(self.optimizer, master)  # moves a loaded "step" to the host

    def _upload_buffer(self, gi: int, up: int) -> Optional[Tensor]:
        """Where the step writes group ``gi``'s 16-bit result (None: upload straight from the master)."""
        bufs = self._uploads[gi]
        if bufs:
            return bufs[up % len(bufs)]
        fg = self.groups[gi]
        return fg.shard16 if self._upload_is_shard16(fg) else None

    def _upload_source(self, gi: int) -> Tensor:
        out = self._upload_buffer(gi, self._upload_from)
        return out if out is not None else self.groups[gi].master

    def _record_h2d(self, up: int) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._h2d_events[up] = ev

    def _wait_h2d(self, up: int) -> None:
        """The host buffer ``up`` is about to be rewritten: its previous upload must have finished."""
        ev = self._h2d_events.pop(up, None)
        if ev is not None:
            ev.synchronize()

    # ---------------------------------------------------------------- states off the device
    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        """Masters and optimizer states resident and current inside the block (checkpoints)."""
        if self._dpu_future is not None:
            self._dpu_future.result()  # the background step must finish first (its upload stays pending)
        with ExitStack() as stack:
            if self._opt_store is not None:
                stack.enter_context(self._opt_store.host_state())
            stack.enter_context(self._compact_host_state())  # compact_state.py: torch's fp32 layout inside
            if self._share is not None:  # entered last: pulls into, and pushes from, resident host tensors
                stack.enter_context(self._share.mirrored(self._host_trio))
            yield

    def teardown(self) -> None:
        """End of fit/validate/test: finish the background step; bring swapped state back into host
        memory when it fits there and remove the swap files (else they stay until the engine goes)."""
        if self._eager is not None:  # backward ran, the step never came (an exception): let the thread finish
            eager, self._eager = self._eager, None
            eager.finish()
            self._upload_from, self._upload_pending = self._up, True
        self._finish_delayed_update()
        if self._swapper is None or self._swap_closed:
            return
        stores = [s for s in (self._opt_store, getattr(self, "_param_store", None)) if s is not None]
        if all(s.resident for s in stores):
            return
        need = sum(_resident_bytes(s) for s in stores)
        if need > 0.8 * available_host_bytes():
            log.warning("lightning_zero: NVMe swap files kept after teardown (%.1f GiB would not fit in host memory); "
                        "they are removed when the strategy is garbage collected or the process exits.", need / 2**30)
            return
        try:
            for s in stores:
                s.keep_in_memory()
        except SwapFileError as err:  # training already failed on it: the files are useless, remove them
            log.error("lightning_zero: swap files removed at teardown, their state is lost: %s", err)
        self._finalizer()
        self._swap_closed = True

    def abandon(self) -> None:
        """After a failure (this rank's or a peer's): join the background CPU step threads and remove
        the swap files, with no collective (a peer may be gone). The state is lost; the last
        checkpoint is what resumes."""
        if self._eager is not None:
            eager, self._eager = self._eager, None
            try:
                eager.finish()
            except Exception:  # noqa: BLE001 - the failure being handled is the one to report
                pass
        if self._dpu_future is not None:
            future, self._dpu_future = self._dpu_future, None
            try:
                future.result()
            except Exception:  # noqa: BLE001
                pass
        if self._swapper is not None and not self._swap_closed:
            self._swap_closed = True
            self._finalizer()
        super().abandon()  # type: ignore[misc]


    def swap_dir(self) -> Optional[str]:
        return str(self._swapper.dir.path) if self._swapper is not None else None


def _resident_bytes(store: Any) -> float:
    """Host memory a store needs to keep everything resident (teardown)."""
    if isinstance(store, NvmeOptimizerStore):
        return sum(m.numel() * 12 for m in store.masters)
    return sum(fg.layout.shard_numel * 2 for fg in store.groups)


