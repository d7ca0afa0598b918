"""One benchmark configuration, in its own process (or torchrun group): build, train N steps, time them.

Started by ``benchmarks/peers.py``, one process tree per configuration, so that CUDA memory, the
caching allocator, NCCL communicators and DeepSpeed's JIT state never leak from one peer into the
next one's numbers. Each rank appends exactly one JSON line to ``--results-file``:

* ``{"kind": "rank", ...}``: the timed steps, peak memory and versions of that rank; with
  ``--profile``, also ``exposed_comm`` and ``comm_total`` (fractions of the wall time of
  ``--profile-steps`` steps profiled after the timed ones, None where there are no CUDA kernels) and
  their details in ``comm_profile`` (see :class:`CommProfiler`);
* ``{"kind": "error", "status": "skipped" | "failed", "reason": ...}``: when the strategy cannot be
  built (e.g. ``ZeroStrategy(stage=3)`` not implemented yet, DeepSpeed not installed) or training
  raised (e.g. CUDA OOM). The parent turns these into table rows; a failing configuration never
  aborts the whole benchmark.

Run by hand only for debugging, e.g.::

    python benchmarks/peers_worker.py --config zero2 --model gpt_tiny --device cpu --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

REPO = Path(__file__).resolve().parent.parent
import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import Strategy  # noqa: E402
from typing_extensions import override  # noqa: E402

from benchmarks.overlap import comm_overlap  # noqa: E402
from benchmarks.presets import PEERS, model_preset  # noqa: E402

PRECISION = "bf16-mixed"
"""Every configuration trains in bf16 mixed precision (each strategy's own meaning of it)."""


# ---------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class PeerConfig:
    """How to build one benchmarked strategy, and how to construct the model under it."""

    name: str
    """Row label in the table; also the ``--configs`` name."""
    build: Callable[[argparse.Namespace], Union[str, Strategy]]
    """Worker arguments -> the ``Trainer(strategy=...)`` argument. May raise NotImplementedError/ValueError,
    which marks the configuration 'skipped' (not 'failed')."""
    build_in: str = "init_module"
    """Where the network is constructed, each peer's documented path for a large model:
    'init_module': in ``GPTModule.__init__`` under ``trainer.init_module(empty_init=...)`` (straight on
    the device for single/ddp/zero0-2; on the meta device for FSDP, see ``empty_init_on_cuda``);
    'configure_model': in ``LightningModule.configure_model``, inside the strategy's
    ``model_sharded_context`` (DeepSpeed stage 3: ``deepspeed.zero.Init``; lightning_zero stage 3:
    sharded initialisation), so no rank ever holds the whole model."""
    empty_init_on_cuda: Optional[bool] = None
    """``trainer.init_module(empty_init=...)`` on CUDA when ``build_in == 'init_module'``. None lets the
    strategy decide; True builds on the meta device (FSDP then materialises and initialises block by
    block on the GPU as it wraps: Lightning's recommended path, and far faster than a 1.3B CPU init)."""
    single_device_only: bool = False
    """Plain Lightning 'auto' is a single-device run: refuse it in a multi-process launch."""


def _single(args: argparse.Namespace) -> str:
    return "auto"


def _ddp(args: argparse.Namespace) -> str:
    return "ddp"


def _fsdp(args: argparse.Namespace) -> Strategy:
    """Lightning's FSDP, FULL_SHARD, one FSDP unit per transformer block (Lightning's recommended setup)."""
    from examples.gpt import Block
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})


def _deepspeed(stage: int) -> Callable[[argparse.Namespace], Strategy]:
    """Lightning's ``deepspeed_stage_N`` preset. It keeps our torch AdamW(fused=True) as DeepSpeed's
    client optimizer (``zero_allow_untested_optimizer`` is on by default), so no op needs a JIT build.
    The logging batch size is given, not inferred from a dataloader Lightning would build early."""

    def build(args: argparse.Namespace) -> Strategy:
        import deepspeed  # noqa: F401  (fail here, with DeepSpeed's own message, if it cannot be imported)
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=stage, logging_batch_size_per_gpu=args.micro_batch)

    return build


def _zero(stage: int) -> Callable[[argparse.Namespace], Strategy]:
    def build(args: argparse.Namespace) -> Strategy:
        from lightning_zero import ZeroStrategy

        return ZeroStrategy(stage=stage)

    return build


CONFIGS: dict[str, PeerConfig] = {
    c.name: c
    for c in (
        PeerConfig("single", _single, single_device_only=True),
        PeerConfig("ddp", _ddp),
        PeerConfig("fsdp", _fsdp, empty_init_on_cuda=True),
        PeerConfig("deepspeed_stage_2", _deepspeed(2)),
        PeerConfig("deepspeed_stage_3", _deepspeed(3), build_in="configure_model"),
        PeerConfig("zero0", _zero(0)),
        PeerConfig("zero1", _zero(1)),
        PeerConfig("zero2", _zero(2)),
        PeerConfig("zero3", _zero(3), build_in="configure_model"),
    )
}
"""How each configuration named in ``presets.PEERS`` is built (the default lists live there too)."""
assert set(CONFIGS) == set(PEERS), "presets.PEERS and peers_worker.CONFIGS must name the same configurations"


# ---------------------------------------------------------------------------------------------------- timing


class StepTimer(Callback):
    """Wall time per training step with the device synchronised at each step boundary.

    [Note: what a step is] A step is the time between the synchronised ends of two consecutive
    training batches: data fetch, host-to-device copy, forward, backward, every collective the
    strategy issues (also ones it defers to the next batch's start) and the optimizer step. Its inner
    part, batch start to batch end, is recorded as well. The first ``warmup`` steps (allocator growth,
    cuBLAS heuristics, NCCL communicator set-up, DeepSpeed's first-step bookkeeping) are dropped.
    One synchronisation per step costs nothing measurable at ~100 ms steps and makes each step's
    time its own.
    """

    def __init__(self, warmup: int, timed: Optional[int] = None) -> None:
        super().__init__()
        self.warmup = warmup
        self.timed = timed
        """None: every step after warm-up is timed (and peak memory is read at train end). A number:
        only that many (the steps after them are profiled, see :class:`CommProfiler`), and peak memory
        is read at the end of the last timed one."""
        self.steps_seen = 0
        self.step_times: list[float] = []
        self.inner_times: list[float] = []
        self.tokens_per_step = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.last_loss: Optional[torch.Tensor] = None
        self._device: Optional[torch.device] = None
        self._last_end: Optional[float] = None
        self._start = 0.0

    def _now(self) -> float:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = self._now()
        if self._last_end is None:
            self._last_end = self._start

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = self._now()
        if self.timed is not None and self.steps_seen >= self.warmup + self.timed:
            return  # a profiled step: the timed ones' times, memory and loss stand as they are
        if self.steps_seen >= self.warmup:
            assert self._last_end is not None
            self.step_times.append(end - self._last_end)
            self.inner_times.append(end - self._start)
            if self.timed is not None and len(self.step_times) == self.timed:
                self._read_peak_memory()
        self._last_end = end
        self.steps_seen += 1
        self.tokens_per_step = int(batch[0].numel())
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.last_loss = loss.detach()

    def _read_peak_memory(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            self.peak_allocated = torch.cuda.max_memory_allocated(self._device)
            self.peak_reserved = torch.cuda.max_memory_reserved(self._device)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.timed is None:
            self._read_peak_memory()


# ---------------------------------------------------------------------------------------------------- profiling

PROFILE_WINDOW = "lz_profiled_steps"
"""The ``record_function`` range that marks the profiled steps: its span is the wall time of the window."""
DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Kineto activity types (their strings) of device-side events that are work. The other CUDA-side ones
are not: ``gpu_user_annotation`` (``record_function`` ranges mirrored onto the GPU timeline: ours,
Lightning's, the optimizer's, spanning whole phases) and ``cuda_sync`` (a synchronisation's wait,
e.g. the compute stream waiting on an NCCL kernel: counting it as work would hide that kernel)."""
SYNC_NAME = re.compile(r"(^| )Sync$|^Stream Wait Event$|^cudaProfilerRange|^ProfilerStep#")
"""Names of CUDA-side non-work events, for when the activity type is unavailable."""


def _profiler_rows(prof: Any) -> tuple[list[tuple[str, Any, float, float, Any, bool, Any]], list[str]]:
    """Every event of a stopped ``torch.profiler.profile`` as (name, device type, start_us, end_us,
    activity type or None, is user annotation, device index or None), and notes.

    First the raw ``prof.profiler.kineto_results.events()`` (start/end in ns on one clock): reading them
    takes about a second for 100k events, where ``prof.events()`` builds FunctionEvents and their tree
    at ~20x the cost (tens of seconds for a few GPT-1.3B steps). If the raw API is missing or has
    changed, ``prof.events()`` (``time_range`` in us from the trace start), with a note.
    """

    def opt(obj: Any, attr: str, default: Any = None) -> Any:
        fn = getattr(obj, attr, None)
        try:
            return fn() if callable(fn) else default
        except Exception:  # noqa: BLE001
            return default

    try:
        rows = []
        for k in prof.profiler.kineto_results.events():
            if opt(k, "is_hidden_event", False):
                continue
            rows.append((k.name(), k.device_type(), k.start_ns() / 1e3, k.end_ns() / 1e3, opt(k, "activity_type"),
                         bool(opt(k, "is_user_annotation", False)), opt(k, "device_index")))
        return rows, []
    except Exception as exc:  # noqa: BLE001 - an API change must not cost the row
        note = f"kineto_results.events() unusable ({short_reason(exc)}): used prof.events()"
    rows = []
    for e in prof.events():
        rows.append((e.name, e.device_type, float(e.time_range.start), float(e.time_range.end),
                     getattr(e, "activity_type", None), bool(getattr(e, "is_user_annotation", False)),
                     getattr(e, "device_index", None)))
    return rows, [note]


def _device_activity(
    prof: Any, device_index: Optional[int]
) -> tuple[list[tuple[str, float, float]], Optional[tuple[float, float]], dict[str, int], list[str]]:
    """(device work as (name, start_us, end_us), the window's (start_us, end_us), counts of the CUDA-side
    events by activity type, notes) from a stopped ``torch.profiler.profile``.

    Device work is the CUDA-side events of a :data:`DEVICE_WORK` activity type (kernels, memcpy,
    memset); without activity types, every CUDA-side event that is neither a user annotation nor named
    like a synchronisation. Only the given device's events are kept (when any carry its index).
    """
    from torch.autograd import DeviceType

    rows, notes = _profiler_rows(prof)
    annotation_names = {name for name, dev, _, _, act, ann, _ in rows
                        if dev == DeviceType.CPU and (ann or (act and "annotation" in str(act)))}
    windows = [(s, e) for name, dev, s, e, _, _, _ in rows if dev == DeviceType.CPU and name == PROFILE_WINDOW]
    types: dict[str, int] = {}
    by_type: list[tuple[str, float, float, Any]] = []
    by_name: list[tuple[str, float, float, Any]] = []
    for name, dev, s, e, act, ann, index in rows:
        if dev != DeviceType.CUDA:
            continue
        types[str(act)] = types.get(str(act), 0) + 1
        if str(act) in DEVICE_WORK:
            by_type.append((name, s, e, index))
        if not (ann or name in annotation_names or SYNC_NAME.search(name) or "annotation" in str(act)
                or "sync" in str(act)):
            by_name.append((name, s, e, index))
    device = by_type
    if not by_type and by_name:
        device = by_name
        notes.append(f"no CUDA event of activity type {sorted(DEVICE_WORK)} (types: {types}): "
                     "device work told from annotations and syncs by name")
    if device_index is not None and any(i == device_index for *_, i in device):
        device = [d for d in device if d[3] == device_index]
    elif device and device_index is not None:
        notes.append(f"no event carries device index {device_index}: used all devices' events")
    window = windows[0] if len(windows) == 1 else None
    if window is None:
        notes.append(f"{len(windows)} '{PROFILE_WINDOW}' ranges found: wall = span of the device activity")
    return [(n, s, e) for n, s, e, _ in device], window, types, notes


class CommProfiler(Callback):
    """Profiles ``steps`` training steps after the first ``start_after`` ones, then measures how much
    device time was communication and how much of it was exposed (see overlap.py's
    [Note: exposed communication]).

    The window runs from one synchronised step end (after ``start_after`` steps: the timed ones are
    over, so their numbers carry no profiler overhead) to the synchronised end of ``steps`` steps
    later, like :class:`StepTimer`'s steps, and is marked with a ``record_function`` range so that its
    wall time is read on the profiler's own clock. Every rank profiles (profiling one rank only would
    slow it and show up as the others' wait inside NCCL). Nothing is exported; the trace is dropped
    after the numbers are taken. Any profiler failure becomes a note, never a failed row.
    """

    def __init__(self, start_after: int, steps: int = 3) -> None:
        super().__init__()
        self.start_after = start_after
        self.steps = steps
        self.seen = 0
        self.result: dict[str, Any] = {}
        self._prof: Any = None
        self._window: Any = None
        self._profiled = 0
        self._device: Optional[torch.device] = None

    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if self._device is not None and self._device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        try:
            self._sync()
            self._prof = profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False)
            self._prof.start()
            self._window = record_function(PROFILE_WINDOW)
            self._window.__enter__()
        except Exception as exc:  # noqa: BLE001
            self.result = {"note": f"profiler did not start: {short_reason(exc)}"}
            if self._prof is not None:
                try:
                    self._prof.stop()  # started, then the window failed: never leave it recording
                except Exception:  # noqa: BLE001
                    pass
            self._prof = self._window = None

    def _stop(self) -> None:
        prof, window, self._prof, self._window = self._prof, self._window, None, None
        notes: list[str] = []
        try:
            self._sync()
            if window is not None:
                window.__exit__(None, None, None)
            prof.stop()
        except Exception as exc:  # noqa: BLE001
            self.result = {"note": f"profiler did not stop cleanly: {short_reason(exc)}"}
            return
        if self._profiled < self.steps:
            notes.append(f"only {self._profiled} of {self.steps} steps profiled")
        try:
            t0 = time.perf_counter()
            index = self._device.index if self._device is not None and self._device.type == "cuda" else None
            kernels, span, types, more = _device_activity(prof, index)
            notes += more
            measured = comm_overlap(kernels, span)
            self.result = {**measured.as_dict(), "steps": self._profiled, "cuda_event_types": types,
                           "analysis_s": time.perf_counter() - t0}
            if not kernels:
                notes.append("no CUDA kernel events" + (" (CPU run)" if index is None else ""))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            notes.append(f"analysis failed: {short_reason(exc)}")
        if notes:
            self.result["note"] = "; ".join(notes)

    @property
    def exposed_comm(self) -> Optional[float]:
        return self.result.get("exposed_fraction")

    @property
    def comm_total(self) -> Optional[float]:
        return self.result.get("comm_fraction")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.seen += 1
        if self._prof is not None:
            self._profiled += 1
            if self._profiled >= self.steps:
                self._stop()
        elif self.seen == self.start_after and not self.result:
            self._start()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._prof is not None:  # training ended inside the window
            self._stop()
        elif not self.result:
            self.result = {"note": f"training ended after {self.seen} steps, before profiling began"}


# ---------------------------------------------------------------------------------------------------- records


def _rank() -> int:
    """Global rank before (or without) a Trainer: torchrun's RANK, else 0."""
    return int(os.environ.get("RANK", "0"))


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, one write(2) on an O_APPEND file: lines from concurrent ranks never interleave."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Optional[str]]:
    """Versions of everything that shapes the numbers (metadata only: importing DeepSpeed is slow)."""
    import lightning

    import lightning_zero

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "deepspeed": _version("deepspeed"),
        "lightning_zero": lightning_zero.__version__,
        "python": sys.version.split()[0],
    }


def short_reason(exc: BaseException) -> str:
    """One line for the table: exception type and the first line of its message, capped."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def device_info(device: torch.device) -> tuple[str, Optional[float]]:
    """Device name for the table and its peak dense bf16 FLOP/s (for MFU), from lightning_zero's table."""
    if device.type != "cuda":
        import platform

        return (platform.processor() or platform.machine() or "cpu"), None
    from lightning_zero.logging.metrics import peak_bf16_flops

    name = torch.cuda.get_device_name(device)
    return name, peak_bf16_flops(name)


# ---------------------------------------------------------------------------------------------------- run


def count_params(cfg: Any) -> int:
    """Parameters of the network, counted on the meta device (exact, free, and independent of how a
    strategy has sharded or flattened the real ones)."""
    from examples.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def build_module(spec: PeerConfig, args: argparse.Namespace, trainer: Trainer, cfg: Any) -> LightningModule:
    """The GPTModule, constructed where ``spec.build_in`` says (see :class:`PeerConfig`)."""
    from examples.gpt import GPT, GPTModule

    # The LR horizon is the warm-up + timed steps with or without --profile (profiled steps after it run
    # at the final LR), so a profiling run's timed steps are those of a plain run. Every configuration
    # trains the plain GPT nn.Module (pipeline=False, the example's default too; pipeline=True wraps the
    # same layers in a PipelineModule), so all peers run one network with the same parameter names and
    # ZeRO-3 units.
    kwargs = {"fused": None if args.no_fused else True, "max_steps": args.warmup + args.steps, "pipeline": False}
    if spec.build_in == "init_module":
        empty_init = spec.empty_init_on_cuda if args.device == "cuda" else None
        with trainer.init_module(empty_init=empty_init):
            return GPTModule(cfg, **kwargs)

    class DeferredGPTModule(GPTModule):
        """GPTModule whose network is built in ``configure_model`` (sharded initialisation)."""

        @override
        def _build_model(self) -> Any:
            return None  # __init__ builds nothing; configure_model does

        @override
        def configure_model(self) -> None:
            super().configure_model()  # a GPTModule that builds there itself keeps doing so
            if getattr(self, "model", None) is None:
                self.model = GPT(self.config)

    return DeferredGPTModule(cfg, **kwargs)


def gpt_worker_parser(doc: Optional[str], configs: Iterable[str], steps: int = 15, warmup: int = 5) -> argparse.ArgumentParser:
    """The arguments every GPT benchmark worker takes (this one, compile_worker.py, fabric_worker.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=sorted(configs))
    p.add_argument("--model", default="gpt_1b", help="conf/model preset name or a YAML path")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps before them")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=1, help="processes (GPUs) in this run")
    p.add_argument("--no-fused", action="store_true", help="torch AdamW without fused=True")
    p.add_argument("--results-file", type=Path, required=True)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = gpt_worker_parser(__doc__, CONFIGS)
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile --profile-steps more and record the exposed communication")
    p.add_argument("--profile-steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.profile and args.profile_steps < 1:
        p.error("--profile-steps must be >= 1")
    return args


def build_trainer(
    args: argparse.Namespace, strategy: Union[str, Strategy], timer: StepTimer, profiler: Optional[CommProfiler] = None
) -> Trainer:
    """A Trainer that does nothing but train: no validation, checkpoints, logger, progress bar or summary.
    With a profiler, it runs the profiled steps after the timed ones (the timer ignores them)."""
    return L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.devices,
        num_nodes=1,
        strategy=strategy,
        precision=PRECISION,
        max_steps=args.warmup + args.steps + (profiler.steps if profiler is not None else 0),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=None,
        callbacks=[timer] if profiler is None else [timer, profiler],  # the timer synchronises first
    )


def rank_record(
    args: argparse.Namespace, trainer: Trainer, model: Any, timer: StepTimer, n_params: int,
    profiler: Optional[CommProfiler] = None,
) -> dict:
    """What the parent needs from one rank to build its row (with ``--profile``: ``exposed_comm`` and
    ``comm_total``, fractions of the profiled wall time or None, and the details in ``comm_profile``)."""
    name, peak = device_info(trainer.strategy.root_device)
    peak_mem = timer.peak_allocated
    if args.device != "cuda":
        from lightning_zero.logging.metrics import peak_host_rss_bytes

        peak_mem = peak_host_rss_bytes() or 0
    record = {
        "kind": "rank",
        "config": args.config,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device_type": args.device,
        "device_name": name,
        "peak_flops": peak,
        "step_times_s": timer.step_times,
        "inner_times_s": timer.inner_times,
        "tokens_per_step_local": timer.tokens_per_step,
        "peak_mem_bytes": peak_mem,
        "peak_reserved_bytes": timer.peak_reserved,
        "final_loss": float(timer.last_loss) if timer.last_loss is not None else None,
        "fused": not args.no_fused,
        "flops_per_token": float(model.flops_per_token),
        "n_params": n_params,
        "versions": versions(),
        "micro_batch": args.micro_batch,
        "strategy_class": type(trainer.strategy).__name__,
    }
    if profiler is not None:
        record.update(exposed_comm=profiler.exposed_comm, comm_total=profiler.comm_total, comm_profile=profiler.result)
    return record


def _shutdown_process_group() -> None:
    """Tear NCCL down explicitly: exiting with a live communicator can hang or print warnings at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the numbers are recorded already; never fail the run on teardown
            print(f"destroy_process_group failed: {short_reason(exc)}", file=sys.stderr)


def run_as_row(args: argparse.Namespace, build_strategy: Callable[[], Any], body: Callable[[Any], None],
               skip_on: tuple[type[BaseException], ...] = (NotImplementedError, ValueError)) -> int:
    """One configuration in this worker: a strategy that cannot be built here (``skip_on``) becomes a
    'skipped' row, any other failure a 'failed' row with its traceback in the log; the parent renders
    its table from these rows (peers.py, lora.py and checkpoint.py share this)."""
    base = {"kind": "error", "config": args.config, "rank": _rank()}
    try:
        strategy = build_strategy()
    except skip_on as exc:
        append_record(args.results_file, {**base, "status": "skipped", "reason": short_reason(exc)})
        return 0
    except Exception as exc:  # e.g. `import deepspeed` failing on this machine
        append_record(args.results_file, {**base, "status": "failed", "reason": short_reason(exc)})
        return 1
    try:
        body(strategy)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes a table row, with its traceback in the log
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc()
        append_record(args.results_file, {**base, "status": "failed", "reason": short_reason(exc)})
        return 1
    return 0


def worker_main(argv: Optional[list[str]], parse: Callable[[Optional[list[str]]], argparse.Namespace],
                run_one: Callable[[argparse.Namespace], int], ignore: tuple[str, ...] = ()) -> int:
    """A benchmark worker's entry point: quiet known warnings, record this pid (the parent kills
    workers that outlive their launcher: torchrun puts each in its own session), run."""
    for pattern in (".*does not have many workers.*", ".*smaller than the logging interval.*", *ignore):
        warnings.filterwarnings("ignore", pattern)
    args = parse(argv)
    with args.results_file.with_suffix(".pids").open("a") as fh:
        fh.write(f"{os.getpid()}\n")
    code = run_one(args)
    sys.stdout.flush()
    return code


def run(args: argparse.Namespace) -> int:
    spec = CONFIGS[args.config]
    if spec.single_device_only and args.devices != 1:
        row = {"kind": "error", "config": args.config, "rank": _rank()}
        append_record(args.results_file, {**row, "status": "skipped", "reason": "single-device run (use 1 GPU)"})
        return 0
    return run_as_row(args, lambda: spec.build(args), lambda strategy: _fit(args, spec, strategy))


def _fit(args: argparse.Namespace, spec: PeerConfig, strategy: Any) -> None:
    from examples.data import TextDataModule
    from examples.gpt import GPTConfig

    L.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    cfg = GPTConfig(**model_preset(args.model))
    profiler = CommProfiler(args.warmup + args.steps, args.profile_steps) if args.profile else None
    timer = StepTimer(args.warmup, timed=args.steps if profiler is not None else None)
    trainer = build_trainer(args, strategy, timer, profiler)
    model = build_module(spec, args, trainer, cfg)
    data = TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch)
    trainer.fit(model, datamodule=data)
    if len(timer.step_times) < args.steps:
        raise RuntimeError(f"only {len(timer.step_times)} of {args.steps} timed steps ran (too little data?)")
    append_record(args.results_file, rank_record(args, trainer, model, timer, count_params(cfg), profiler))
    _shutdown_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    return worker_main(argv, parse_args, run)


__all__ = ["CONFIGS", "CommProfiler", "PeerConfig", "StepTimer", "append_record", "run", "run_as_row", "worker_main", "main"]


if __name__ == "__main__":
    sys.exit(main())
