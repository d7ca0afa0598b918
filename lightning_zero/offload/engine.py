"""Offload mixed into the ZeRO engines: what changes when masters, states and partitions leave the device.

:class:`OffloadMixin` (here) is what every stage shares: it overrides the ZeRO engine's marked steps and
hands the host side to two objects it builds once: the host optimizer (host_optimizer.py [Note: the host
optimizer]: masters, host gradients, upload buffers and the upload state, with the NVMe store, the device
share and the compact states as its members) and the step policy (policy.py [Note: step policies]:
synchronous, during backward (eager.py), or delayed (delayed.py)). flat.py (stages 1-2) and sharded.py
(stage 3) add the write-back; engines.py names the three engines. The marked steps, in the order a step
runs them:

1. construction (``_group_kwargs``): masters in host memory (NVMe: swapped out once built); stage 3's
   gather source ``shard16`` on the device, in pinned host memory, or in swap files;
2. ``_reduce_scatter_into_shard``: each reduced gradient chunk is copied device-to-host into the
   pinned landing buffer as soon as its reduce-scatter finishes (CUDA: on a side stream that waits
   for the collective, overlapping the rest of backward); its squared norm is summed on the device;
   with the step during backward the policy steps the chunk's range as soon as it has landed;
3. ``global_grad_norm_sq`` / ``_master_grads``: the norm from the device sums (one micro-batch) or
   from the host gradients (accumulated);
4. ``_step_masters``: the step policy runs the CPU step (cpu.py; NVMe: swap_state.py's chunk pipeline),
   writing the 16-bit result into the pinned upload buffer, or finishes the one that ran during
   backward, or (delayed update) starts it in a background thread and uploads the *previous* step's
   result instead; with ``offload_ratio`` < 1 the device share then steps on the device (device_share.py);
5. ``_write_back`` (stages 1-2) / ``_refresh_shards`` (stage 3): host-to-device upload of what the upload
   state (upload.py [Note: the upload state]) says is pending, then the stage's own all-gather (1-2) or
   nothing more (3: the next forward gathers unit by unit, copying each unit's chunk to the device
   first through ``_gather_source``).

[Note: delayed parameter update] is in delayed.py.

[Note: one code path on CPU]
On a CPU-only machine "device" and "host" are both CPU memory, but every buffer above is still a
separate allocation and every copy still happens, so CI runs the offload code paths (and NVMe
swapping fully) exactly as a GPU machine does; only streams, events and pinning are skipped.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.offload import estimator as est
from lightning_zero.config.offload import OffloadConfig
from lightning_zero.offload.compact_state import master_in_params
from lightning_zero.offload.cpu import HostGradShard, sum_of_squares
from lightning_zero.offload.device_share import DeviceShare
from lightning_zero.offload.host_optimizer import HostOptimizer
from lightning_zero.offload.nvme import NvmeSwapper, SwapDir, SwapFileError, check_nvme_path
from lightning_zero.offload.pinned import HostPool, available_host_bytes, can_pin, check_host_memory
from lightning_zero.offload.policy import StepPolicy, choose_step_policy
from lightning_zero.offload.settings import OffloadHost
from lightning_zero.offload.swap_state import NvmeOptimizerStore
from lightning_zero.optim import host_states
from lightning_zero.optim.host_states import HostAdamState
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.zero.engine import _Pending, squared_norm
from lightning_zero.zero.loss_scaler import DynamicLossScaler

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
    setattr(optimizer, "_opt_called", True)  # an attribute torch's optimizers do not declare


if TYPE_CHECKING:  # the engine classes this mixin goes in front of (engines.py), for the type checker
    from lightning_zero.zero.stage1 import Stage1Engine as _EngineBase
else:
    _EngineBase = object


class OffloadMixin(_EngineBase):
    """Optimizer offload for stages 1-3 (see the module docstring). Put before the engine class; what lives
    in host memory is ``host_optimizer`` (host_optimizer.py), when the CPU step runs is ``step_policy``
    (policy.py), both built once here."""

    single_rank_shortcuts = False
    """Shards live in host memory: no shortcut of stage2.py's [Note: one data-parallel rank]."""

    host_optimizer: HostOptimizer
    step_policy: StepPolicy

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
        super().__init__(optimizer, dp_group, compute_dtype, device, bucket_numel, *args, **kwargs)
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
            accumulate=self._accumulating, nvme_chunk_numel=self.offload.nvme_chunk_numel,
            nvme_fraction=self.offload.nvme_fraction,
            state_bytes=host_states.bytes_per_param(host_states.check_precision(self.offload.offload_state_precision)),
            master_in_params=master_in_params(self.offload, compute_dtype, self.stage),
        )

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
        """The host optimizer, then the step policy that drives it (chosen once, here)."""
        self.host_optimizer = HostOptimizer(
            self.optimizer, self.groups, self.offload, self.host, self.device, self.compute_dtype, self._swapper,
            shard16_upload=self._upload_is_shard16, master16=self._compact_master16, dp_rank=self.dp_rank,
            engine_host_state=self.host_state, masters_in_optimizer=self.masters_in_optimizer, pg_of=self.pg_of,
            device_memory=self._device_memory,
        )
        self.step_policy = choose_step_policy(self.host_optimizer, self.offload)
        self._backwards = 0
        self._dev_sq: Optional[Tensor] = None
        self._d2h = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.step_in_backward = False
        """Set by the strategy before each step: run this step's CPU update during backward (eager.py)."""

    def _upload_is_shard16(self, fg: Any) -> bool:
        """Stage 3 with parameters in host memory: the CPU step writes the partitions in place."""
        return False

    def _compact_master16(self, fg: Any) -> Optional[Tensor]:
        """The 16-bit partition that holds a bf16 compact master (compact_state.master_in_params), or None."""
        if not master_in_params(self.offload, self.compute_dtype, self.stage):
            return None
        assert self._upload_is_shard16(fg)
        return fg.shard16

    def _device_memory(self) -> Optional[tuple[int, int]]:
        """(total, peak allocated so far) bytes of this rank's device; None on a CPU-only run, where
        device and host memory are the same and ``offload_ratio='auto'`` keeps everything on the host."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(self.device).total_memory, torch.cuda.max_memory_allocated(self.device)

    # ---------------------------------------------------------------- what tests and tools read
    @property
    def eager_steps(self) -> int:
        """Steps that ran during backward (tests and benchmarks read it)."""
        return self.step_policy.eager_steps

    @property
    def chosen_ratio(self) -> Optional[float]:
        """The host share ``offload_ratio='auto'`` chose after the first step (None before, or on CPU)."""
        return self.host_optimizer.chosen_ratio

    @property
    def _share(self) -> Optional[DeviceShare]:
        return self.host_optimizer.share

    @property
    def _splits(self) -> list[int]:
        return self.host_optimizer.splits

    @property
    def _grads(self) -> list[HostGradShard]:
        return self.host_optimizer.grads

    @property
    def _uploads(self) -> list[list[Tensor]]:
        return self.host_optimizer.uploads.buffers

    @property
    def _compact(self) -> Optional[list[HostAdamState]]:
        compact = self.host_optimizer.compact
        return compact.states if compact is not None else None

    @property
    def _opt_store(self) -> Optional[NvmeOptimizerStore]:
        return self.host_optimizer.opt_store

    # ---------------------------------------------------------------- backward: gradients to the host
    def _reduce_scatter_into_shard(self, gi: int, bi: int, bucket: Tensor, after: Optional[Any] = None) -> _Pending:
        grads = self.host_optimizer.grads
        if any(hg.fresh for hg in grads):  # a new micro-batch: keep the previous one (accumulation)
            self._sync_d2h()
            for hg in grads:
                hg.fold()
        eager = self.step_policy.for_backward(self.step_in_backward, self._backwards, self.used)
        if eager is not None and self._bw.missing[(gi, bi)] > 0:
            eager = None  # a parameter without a gradient here: stepped at the step, under its plan (masked.py)
        fg = self.groups[gi]
        b = fg.layout.buckets[bi]
        lo, hi = b.shard_offset, b.shard_offset + b.chunk
        bucket.div_(self.dp_size)
        out = bucket.new_empty(b.chunk)
        work = C.reduce_scatter(out, bucket, self.dp_group, async_op=True)
        share = self.host_optimizer.share
        if share is not None and share.owns(gi, lo):  # partial offload: this chunk stays here

            def finalize_on_device() -> None:
                share.land(gi, lo, out)
                sq = self._chunk_sq(gi, lo, out)
                self._dev_sq = sq if self._dev_sq is None else self._dev_sq + sq
                if after is not None:
                    after()

            return _Pending(work, finalize_on_device)
        dst = grads[gi].landing[lo:hi]
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
        syncing = self._syncing and not self._nothing_to_reduce()
        super().post_backward()
        if syncing:
            for hg in self.host_optimizer.grads:
                hg.fresh = True
            self._backwards += 1

    def _master_grads(self) -> list[Tensor]:
        self._sync_d2h()
        return [hg.value() for hg in self.host_optimizer.grads]

    def _chunk_sq(self, gi: int, lo: int, chunk: Tensor) -> Tensor:
        """Squared norm of a gradient chunk starting at shard offset ``lo`` of group ``gi``, its replicated
        TP elements weighted by 1/tp (zero/engine.py [Note: gradient norm under tensor parallelism])."""
        sq = squared_norm(chunk)
        tp = self.tp_size
        if tp > 1:
            hi = lo + chunk.numel()
            for a, b in self._replicated[gi]:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    sq = sq - (1.0 - 1.0 / tp) * squared_norm(chunk[a - lo : b - lo])
        return sq

    def global_grad_norm_sq(self, grads: Any) -> Tensor:
        if self._backwards == 1 and self._dev_sq is not None:
            sq = self._dev_sq.float().clone()  # summed on the device as the chunks arrived (reduced in place next)
        else:
            grads = list(grads)
            share = self.host_optimizer.share
            total = sum_of_squares(grads) + (share.grad_sq(self._chunk_sq) if share is not None else 0.0)
            tp = self.tp_size
            if tp > 1:  # replicated TP elements counted once (zero/engine.py [Note: gradient norm under tensor parallelism])
                total -= (1.0 - 1.0 / tp) * sum_of_squares([grads[gi][a:b] for gi in range(len(grads))
                                                            for a, b in self._replicated[gi]])
            sq = torch.tensor(total, dtype=torch.float32, device=self.device)
        return self._reduce_grad_sq(sq)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.step_policy.before_zero_grad()
        super().zero_grad(set_to_none)

    def _zero_grads(self) -> None:
        super()._zero_grads()
        self.host_optimizer.zero_grads()
        self._backwards = 0
        self._dev_sq = None

    # ---------------------------------------------------------------- the CPU step
    @property
    def _step_counted(self) -> bool:
        return self.step_policy.step_counted

    def step(self, clip_val: Optional[float] = None, scaler: Optional[DynamicLossScaler] = None, check_finite: bool = False,
             clip_value: Optional[float] = None) -> bool:
        """Refuses clipping by value with a device share (precision.py [Note: clipping by value]: the clamp
        sees the host share's gradients only)."""
        if clip_value and self._share is not None:
            raise ValueError("gradient_clip_algorithm='value' is not supported with offload_ratio < 1 (the part of "
                             "the partition stepped on the device would go unclipped): use offload_ratio=1 or "
                             "gradient_clip_algorithm='norm'.")
        return super().step(clip_val, scaler, check_finite, clip_value=clip_value)

    def _step_masters(self, grads: list[Tensor], coef: float) -> None:
        note_optimizer_step(self.optimizer)  # see [Note: the LR scheduler sees the CPU step]
        self.step_policy.step(grads, coef, self._plans, self._bucket_stepped)

    def _bucket_stepped(self, gi: int, bi: int) -> None:
        """Bucket ``bi`` of group ``gi`` has its final 16-bit values in the upload source (stages 1-2
        start its upload and all-gather here; stage 3 uploads after the step)."""

    def adopt_param_writes(self) -> None:
        """Parameter changes since the last step into the masters, before a state dict is read (stages 1-2:
        flat.py; stage 3 refuses an in-place change at the unit's release: stage3.py)."""

    def _upload_source(self, gi: int) -> Tensor:
        return self.host_optimizer.uploads.source(gi, self.groups[gi].master)

    # ---------------------------------------------------------------- states off the device
    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        """Masters and optimizer states resident and current inside the block (checkpoints)."""
        self.step_policy.wait()  # the background step must finish first (its upload stays pending)
        with self.host_optimizer.host_state():
            yield

    def teardown(self) -> None:
        """End of fit/validate/test: finish the running or background step; bring swapped state back into
        host memory when it fits there and remove the swap files (else they stay until the engine goes)."""
        self.step_policy.finish(self._write_back)
        if self._swapper is None or self._swap_closed:
            return
        stores = [s for s in (self.host_optimizer.opt_store, getattr(self, "_param_store", None)) if s is not None]
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
        self.step_policy.abandon()
        if self._swapper is not None and not self._swap_closed:
            self._swap_closed = True
            self._finalizer()
        super().abandon()

    def swap_dir(self) -> Optional[str]:
        return str(self._swapper.dir.path) if self._swapper is not None else None


def _resident_bytes(store: Any) -> float:
    """Host memory a store needs to keep everything resident (teardown)."""
    if isinstance(store, NvmeOptimizerStore):
        return sum(m.numel() * 12 for m in store.masters)
    return sum(fg.layout.shard_numel * 2 for fg in store.groups)
