"""Offload mixed into the ZeRO engines: what changes when masters, states and partitions leave the device.

``offload_engine(ENGINES[stage])`` returns the stage's engine class with :class:`FlatOffloadMixin`
(stages 1-2) or :class:`ParamOffloadMixin` (stage 3) in front; both extend :class:`OffloadMixin`. They
override only the engine's marked steps, in the order a step runs them:

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
5. ``_write_back`` (stages 1-2) / ``_refresh_shards`` (stage 3): host-to-device upload, then the
   stage's own all-gather (1-2) or nothing more (3: the next forward gathers unit by unit, copying
   each unit's chunk to the device first through ``_gather_source``).

[Note: delayed parameter update]
With ``delayed_param_update`` (after ``delayed_param_update_warmup`` synchronous steps) step t's CPU
update runs in a background thread while the device computes step t+1, which uses the parameters of
update t-1; step t+1's ``_step_masters`` waits for it, uploads its result and starts update t+1. The
gradients and upload buffers are doubled so that the thread and the device never share one (events
order the uploads). The learning rate etc. are read when the update starts. ``host_state`` waits for
the thread (checkpoints see the latest masters); teardown uploads the last result. The overlap needs
the CPU op to release the GIL (torch's own kernels do); results differ from the synchronous run by
design (tests check the exact one-step staleness).

[Note: one code path on CPU]
On a CPU-only machine "device" and "host" are both CPU memory, but every buffer above is still a
separate allocation and every copy still happens, so CI runs the offload code paths (and NVMe
swapping fully) exactly as a GPU machine does; only streams, events and pinning are skipped.
"""

from __future__ import annotations

import logging
import math
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.offload import estimator as est
from lightning_zero.offload.cpu import (
    AdamHyper, HostGradShard, adam_hyper, adam_update, generic_step, host_adam_state, load_adam_op, sum_of_squares,
)
from lightning_zero.offload.eager import EagerStep, uncovered
from lightning_zero.offload.nvme import NvmeSwapper, SwapDir, SwapFileError, check_nvme_path
from lightning_zero.offload.device_share import DeviceShare, auto_device_numel, auto_ratio, split_at_ratio
from lightning_zero.offload.params import NvmeParamStore, stage_to_device
from lightning_zero.offload.settings import OffloadSettings
from lightning_zero.offload.pinned import HostPool, available_host_bytes, can_pin, check_host_memory
from lightning_zero.offload.swap_state import NvmeOptimizerStore
from lightning_zero.zero.engine import ZeroEngine, _Pending

log = logging.getLogger(__name__)

STEP_CHUNK = 1 << 25
"""Elements per CPU Adam call after backward. The compiled op releases the GIL, so the size does not
matter to it; torch's fallback (no compiler) allocates temporaries as large as its input, which this
bounds to a few hundred MB."""


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


class OffloadMixin:
    """Optimizer offload for stages 1-3 (see the module docstring). Put before the engine class."""

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
                 offload: OffloadSettings, **kwargs: Any) -> None:
        self.offload = offload
        self._pin = can_pin(device, offload.pin_memory)
        self.host = HostPool(pin=self._pin)
        weakref.finalize(self, self.host.release)
        self._accumulating = offload.accumulate
        self._check_resources(optimizer, dp_group, compute_dtype, bucket_numel)
        self._swapper: Optional[NvmeSwapper] = None
        if offload.uses_nvme:
            swap_dir = SwapDir(Path(str(offload.nvme_path)).expanduser(), offload.global_rank)
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
                    total += p.numel()
        return est.Workload(
            total, gpus_per_node=dp_size, compute_bytes=torch.empty((), dtype=compute_dtype).element_size(),
            bucket_numel=bucket_numel, delayed_update=self.offload.delayed_param_update,
            accumulate=self._accumulating, nvme_chunk_numel=self._chunk_numel(), nvme_fraction=self.offload.nvme_fraction,
        )

    def _chunk_numel(self) -> int:
        return self.offload.nvme_chunk_numel

    def _check_resources(self, optimizer: torch.optim.Optimizer, dp_group: Optional[C.ProcessGroup],
                         compute_dtype: torch.dtype, bucket_numel: int) -> None:
        """Host memory and NVMe space, before anything is allocated (the estimator's figures)."""
        o = self.offload
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
        check_host_memory(int(host), o.ranks_per_node, what, advice, available=available_host_bytes())
        if o.uses_nvme:
            need = int(est.nvme_bytes_per_rank(setting, w) * o.ranks_per_node)
            check_nvme_path(o.nvme_path, need, f"offload_optimizer={o.offload_optimizer!r}, offload_params={o.offload_params!r}, "
                            f"{o.ranks_per_node} rank(s) on this node")

    def _host_master(self, numel: int, dtype: torch.dtype) -> Tensor:
        # fp32 training without an upload buffer uploads straight from the masters: pin them then
        if self.offload.offload_optimizer == "nvme":  # swapped out once built: resizable storage (swap_state.make_placeholder)
            return torch.zeros(numel, dtype=dtype)
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
        need_upload = self.compute_dtype != torch.float32 or o.offload_optimizer == "nvme" or dpu
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
        self._eager_possible = o.offload_step_in_backward and o.offload_optimizer == "cpu" and not dpu and self._hypers_ok
        self._eager: Optional[EagerStep] = None
        self._eager_pool: Optional[ThreadPoolExecutor] = None
        self.eager_steps = 0
        """Steps that ran during backward (tests and benchmarks read it)."""

    def _upload_is_shard16(self, fg: Any) -> bool:
        """Stage 3 with parameters in host memory: the CPU step writes the partitions in place."""
        return False

    # ---------------------------------------------------------------- partial offload (device_share.py)
    def _host_trio(self, gi: int) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """Group ``gi``'s full-size host master and Adam moments (None before the first step)."""
        master = self.groups[gi].master
        st = self.optimizer.state.get(master, {})
        return master, st.get("exp_avg"), st.get("exp_avg_sq")

    def _share_from_host(self) -> None:
        """The device shares take their values from the host masters and states (setup, ``auto``)."""
        assert self._share is not None
        for gi in range(len(self.groups)):
            self._share.push(gi, *self._host_trio(gi))

    def _step_device_share(self, coef: float) -> None:
        """The device share's Adam step, after the host share's (same count and hyper-parameters)."""
        if self._share is not None:
            for gi, pg in enumerate(self.optimizer.param_groups):
                hyper = adam_hyper(self.optimizer, pg)
                assert hyper is not None, "offload_ratio < 1 needs Adam (checked at setup)"
                self._share.step(gi, self._step_counts[gi], hyper, 1.0 / coef)
        if self._auto_pending:
            self._auto_pending = False
            self._choose_auto_split()

    def _device_memory(self) -> Optional[tuple[int, int]]:
        """(total, peak allocated so far) bytes of this rank's device; None on a CPU-only run, where
        device and host memory are the same and ``auto`` keeps everything on the host."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(self.device).total_memory, torch.cuda.max_memory_allocated(self.device)

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
        if splits == self._splits:
            return
        with self.host_state():  # NVMe: the states the device share starts from must be resident
            self._splits = splits
            self._share = DeviceShare(splits, numels, self.device, self.compute_dtype)
            self._share_from_host()

    # ---------------------------------------------------------------- backward: gradients to the host
    def _reduce_scatter_into_shard(self, gi: int, bi: int, bucket: Tensor, after: Optional[Any] = None) -> _Pending:
        if any(hg.fresh for hg in self._grads):  # a new micro-batch: keep the previous one (accumulation)
            self._sync_d2h()
            for hg in self._grads:
                hg.fold()
        eager = self._eager_for_this_backward()
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
                sq = out.float().pow(2).sum()
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
            sq = out.float().pow(2).sum()
            self._dev_sq = sq if self._dev_sq is None else self._dev_sq + sq
            if after is not None:
                after()

        return _Pending(work, finalize)

    def _eager_for_this_backward(self) -> Optional[EagerStep]:
        """This backward's step-during-backward, started at its first bucket (None: step after backward)."""
        if self._eager is not None:
            if self._backwards > 0:
                raise RuntimeError(
                    "step_in_backward: a second backward before the optimizer step; the update ran during the "
                    "first one. Set ZeroStrategy(offload_step_in_backward=False) for this training loop."
                )
            return self._eager
        if not (self.step_in_backward and self._eager_possible and self._backwards == 0):
            return None
        self._wait_h2d(self._up)  # the upload buffer about to be written: its last upload must be done
        threads = max(1, torch.get_num_threads() - 1)  # one core stays with the thread driving backward
        ranges = []
        for gi, pg in enumerate(self.optimizer.param_groups):
            hyper = adam_hyper(self.optimizer, pg)  # this step's learning rate
            out = self._upload_buffer(gi, self._up)
            assert hyper is not None and (out is None or out.dtype != torch.float32), "see _eager_possible"
            ranges.append(self._begin_host_adam(gi, self._grads[gi].landing, out, hyper, 1.0, threads))

        def update(gi: int, lo: int, hi: int) -> None:
            ranges[gi](lo, hi)

        if self._eager_pool is None:
            self._eager_pool = ThreadPoolExecutor(1, "lz-step-in-backward")
        self._eager = EagerStep(self._eager_pool, update)
        return self._eager

    def _finish_eager(self, coef: float) -> None:
        """The step that ran during backward: wait for it, step any range it missed, mark the upload."""
        eager, self._eager = self._eager, None
        assert eager is not None
        eager.finish()
        if coef != 1.0:
            raise RuntimeError(
                f"step_in_backward: the step's gradient coefficient is {coef} (clipping or loss scaling), but the "
                "update already ran during backward with 1. Set ZeroStrategy(offload_step_in_backward=False)."
            )
        for gi, lo, hi in uncovered(self._splits, eager.covered):
            eager.run_now(gi, lo, hi)
        self._upload_from = self._up
        for gi, fg in enumerate(self.groups):  # each bucket's upload starts as soon as its range is stepped
            for bi, b in enumerate(fg.layout.buckets):
                if b.shard_offset < self._splits[gi]:
                    eager.wait(gi, b.shard_offset)
                    self._bucket_stepped(gi, bi)
        self._steps += 1
        self._upload_from, self._upload_pending = self._up, True
        self._out_valid = True
        self.eager_steps += 1

    def _push_loaded_share(self) -> None:
        """Masters were loaded (inside ``host_state``): the device share takes them now, before the
        write-back sends its values (the mirror's own push comes only when ``host_state`` ends)."""
        if self._share is not None:
            self._share_from_host()

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

    def global_grad_norm_sq(self, grads: Any) -> Tensor:
        if self._backwards == 1 and self._dev_sq is not None:
            local = self._dev_sq.sqrt().reshape(1)  # summed on the device as the chunks arrived
        else:
            sq = sum_of_squares(list(grads)) + (self._share.grad_sq() if self._share is not None else 0.0)
            local = torch.tensor([math.sqrt(sq)], device=self.device)
        return super().global_grad_norm_sq([local])  # type: ignore[misc]

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
            self._cpu_step(grads, coef, self._up, pipelined=True)
            self._step_device_share(coef)
            self._upload_from, self._upload_pending = self._up, True
            return
        # delayed update: upload the previous step's result, run this step in the background
        if self._dpu_future is not None:
            self._dpu_future.result()
            self._upload_from, self._upload_pending = self._dpu_up, True
        else:
            self._upload_pending = False
        nxt = 1 - self._upload_from if self._upload_pending else 1 - self._up
        self._wait_h2d(nxt)
        hypers = [adam_hyper(self.optimizer, pg) for pg in self.optimizer.param_groups]  # this step's lr
        for hg in self._grads:
            hg.rotate()  # the next backward lands elsewhere
        self._dpu_up = self._up = nxt
        assert self._dpu_pool is not None
        self._dpu_future = self._dpu_pool.submit(self._cpu_step, grads, coef, nxt, hypers)

    def _cpu_step(self, grads: list[Tensor], coef: float, up: int,
                  hypers: Optional[list[Optional[AdamHyper]]] = None, pipelined: bool = False) -> None:
        """The host share's step after backward. ``pipelined`` (the training thread, synchronous step):
        bucket by bucket, each bucket's upload started as soon as it is stepped (``_bucket_stepped``);
        never from the delayed update's thread, which must not issue collectives."""
        opt = self.optimizer
        hypers = hypers or [adam_hyper(opt, pg) for pg in opt.param_groups]
        outs = [self._upload_buffer(gi, up) for gi in range(len(self.groups))]
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
            for bi, b in enumerate(fg.layout.buckets):
                if b.shard_offset >= self._splits[gi]:
                    break  # the device share (device_share.py)
                end = b.shard_offset + b.chunk
                for lo in range(b.shard_offset, end, STEP_CHUNK):  # see STEP_CHUNK
                    update_range(lo, min(end, lo + STEP_CHUNK))
                if out is not None and out.dtype == torch.float32:
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

    def _finish_delayed_update(self) -> None:
        """Wait for the background step and upload its result (collective on stages 1-2: every rank
        tears down), so evaluation and export after fit see the final parameters."""
        if self._dpu_future is None:
            return
        self._dpu_future.result()
        self._dpu_future = None
        self._upload_from, self._upload_pending = self._dpu_up, True
        self._write_back()  # type: ignore[attr-defined]
        self._steps = 0  # a later step starts synchronously again

    def swap_dir(self) -> Optional[str]:
        return str(self._swapper.dir.path) if self._swapper is not None else None


def _resident_bytes(store: Any) -> float:
    """Host memory a store needs to keep everything resident (teardown)."""
    if isinstance(store, NvmeOptimizerStore):
        return sum(m.numel() * 12 for m in store.masters)
    return sum(fg.layout.shard_numel * 2 for fg in store.groups)


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

    def _setup_offload(self) -> None:
        super()._setup_offload()
        self._gather_ready: set[tuple[int, int]] = set()
        self._gather_cursor = 0
        self._gather_works: list[Any] = []

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
        on_device = self._share is not None and self._share.owns(gi, lo)
        chunk = self._share.source(gi, lo, hi) if on_device else self._upload_source(gi)[lo:hi]  # type: ignore[union-attr]
        dst = fg.bucket_view(fg.flat_param, bi)
        if self.dp_size == 1:
            dst.copy_(chunk, non_blocking=True)
        else:
            send = chunk.to(self.compute_dtype) if on_device else stage_to_device(chunk, self.device, self.compute_dtype)
            self._gather_works.append(C.all_gather(dst, send, self.dp_group, async_op=True))

    def after_master_load(self) -> None:
        self._push_loaded_share()
        for gi, fg in enumerate(self.groups):  # the 16-bit upload buffers come from the loaded masters
            out = self._upload_buffer(gi, self._upload_from)
            if out is not None:
                out.copy_(fg.master)
        self._upload_pending = True
        self._write_back()

    def _write_back(self) -> None:
        if not self._upload_pending:
            return
        self._upload_pending = False
        order = self._gather_order()
        while self._gather_cursor < len(order):  # what the step did not start (device share, NVMe, SGD...)
            self._launch_gather(*order[self._gather_cursor])
            self._gather_cursor += 1
        self._record_h2d(self._upload_from)
        works, self._gather_works = self._gather_works, []
        self._gather_cursor, self._gather_ready = 0, set()
        for w in works:
            w.wait()


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
            self._param_store = NvmeParamStore(self._swapper, self.groups, self._pin)
            self._param_store.swap_out()
        super()._setup_offload()

    def _gather_source(self, gi: int, bi: int) -> Tensor:
        if self.offload.offload_params == "none" or gi >= len(self.groups):  # frozen partitions stay on the device
            return super()._gather_source(gi, bi)  # type: ignore[misc]
        fg = self.groups[gi]
        b = fg.layout.buckets[bi]
        store = getattr(self, "_param_store", None)
        if store is not None:
            host = store.host_chunk(gi, bi)
        else:
            assert fg.shard16 is not None
            host = fg.shard16[b.shard_offset : b.shard_offset + b.chunk]
        return stage_to_device(host, self.device)

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


def offload_engine(base: type[ZeroEngine]) -> type[ZeroEngine]:
    """``base`` (a stage-1/2/3 engine class) with offload mixed in."""
    if base.stage == 0:
        raise ValueError("offload needs ZeRO stage >= 1")
    mixin = ParamOffloadMixin if base.stage == 3 else FlatOffloadMixin
    return type(f"Offload{base.__name__}", (mixin, base), {"__doc__": f"{base.__doc__}\n\nWith offload (lightning_zero/offload)."})
