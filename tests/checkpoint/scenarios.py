"""Scenario ``checkpoint.plan`` (tests/helpers/harness.py; CPU, gloo) for the sharded-checkpoint tests: runs a
plan of steps in one process group and records, for each step and rank, ``<name>`` (``OUT/<name>.rank<r>.pt``)
as soon as that step is over.

Params: ``{"plan": [step, ...]}``, a list of steps (dicts), run in order; ``task`` is one of

* ``fit`` (default): seed, build ``model`` (``net``: CkptNet, ``gan``: TinyGAN; tests/checkpoint/models.py)
  and fit it for ``steps`` global steps under ``strategy``: ``ddp``, ``zero0``-``zero3``,
  ``zero3_offload`` (offload_optimizer/params "cpu"), ``zero3_offload_nvme`` (both "nvme", a fresh
  ``nvme_path`` per step), with ``zero`` (extra ZeroStrategy options, e.g. checkpoint_async). Keys:

  - ``ckpt``: a ModelCheckpoint (``dirpath``, ``every`` = every_n_train_steps, ``top_k``, ``save_last``,
    ``monitor``, ``mode``);
  - ``save_at``: {step: path}: ``trainer.save_checkpoint(path)`` after that global step (in
    ``on_train_batch_end``, as ModelCheckpoint does); with ``track_memory`` the save runs inside
    ``NewStorageTracker`` (tests/helpers/memory.py) and ``mem`` records the peak of new storage, this
    rank's own partitions (fp32 masters + two Adam states of every trainable shard, frozen shards) and,
    under stage 3, the peak of a ``full_state_dict()`` (a gather, to show the tracker sees one);
  - ``capture_at``: global steps after which ``full_state_dict()`` is recorded (``captured``; rank 0);
  - ``resume``: ``ckpt_path`` for ``fit`` (a path or ``"last"``);
  - ``record_start``: at ``on_train_start`` (after the restore) record ``start_step`` and the full
    weights (``start_state``; ddp also the optimizer and scheduler states), and with ``resave`` save
    a checkpoint there right away (the state as loaded, for the tests to consolidate);
  - ``kill_on_save``: rank 1 SIGKILLs itself during its n-th ``trainer.save_checkpoint`` (ModelCheckpoint's
    ``last`` saves count too), right after the first write into one of its ``.distcp`` files (any writer
    that opens them through ``open``/``io.open``/``Path.open``), leaving ``OUT/kill_marker``;
  - ``wait``: call ``strategy.wait_for_checkpoint()`` after fit.

* ``consolidate``: rank 0 runs ``lightning_zero.checkpoint.consolidate(src, dst)``, every rank waits.

Every rank records its own losses (``(global_step, loss)``), and any exception: ``error`` (traceback),
``exc_type``, ``exc_msg``, ``exc_corrupt`` (an instance of ``lightning_zero.checkpoint.CorruptCheckpointError``).
After a failed step the ranks go on only if they all meet at a barrier (else the worker exits 3).
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from tests.checkpoint.models import MODELS  # noqa: E402
from tests.helpers.parity_runs import offload_kwargs  # noqa: E402
from tests.helpers.memory import NewStorageTracker  # noqa: E402
from tests.helpers.harness import barrier_or_exit, ScenarioContext, scenario  # noqa: E402

COLLECTIVE_TIMEOUT_S = 60
BUCKET_MB = 0.01
"""Small buckets (10 KiB) against a ~0.9 MB model + Adam state: 'one bucket' and 'the whole model' differ ~85x."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# ------------------------------------------------------------------ strategies
def make_strategy(step: dict, out: str) -> Any:
    spec = step["strategy"]
    if spec == "ddp":
        return DDPStrategy(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    base, _, offload = spec.partition("_")
    kwargs: dict[str, Any] = {"stage": int(base[-1]), "bucket_size_mb": BUCKET_MB,
                              "timeout_s": float(COLLECTIVE_TIMEOUT_S)}
    if kwargs["stage"] == 3:
        kwargs["param_persistence_threshold"] = 0  # a tiny model: partition every unit
    if offload == "offload":
        kwargs.update(offload_kwargs({"oopt": "cpu", "oparams": "cpu"}))
    elif offload == "offload_nvme":
        nvme = os.path.join(out, f"{step['name']}_nvme")
        os.makedirs(nvme, exist_ok=True)
        kwargs.update(offload_kwargs({"oopt": "nvme", "oparams": "nvme", "nvme": nvme}))
    elif offload:
        raise ValueError(f"unknown strategy {spec!r}")
    kwargs.update(step.get("zero", {}))
    return lightning_zero.ZeroStrategy(**kwargs)


def full_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Full fp32 weights by state-dict name (collective under ZeRO)."""
    if isinstance(trainer.strategy, DDPStrategy):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state = trainer.strategy.full_state_dict()
    return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in state.items()}


def own_partition_bytes(trainer: pl.Trainer) -> int:
    """This rank's partitions: fp32 master shards with their two Adam states, and stage 3's frozen shards
    (sizes from numel: NVMe offload keeps them on disk between steps)."""
    total = 0
    for engine in getattr(trainer.strategy, "engines", []):
        for fg in engine.groups:
            total += 3 * fg.master.numel() * fg.master.element_size()
        for fg in getattr(engine, "frozen_groups", []):
            total += fg.master.numel() * fg.master.element_size()
    return total


# ------------------------------------------------------------------ the kill switch
class _Kill:
    armed = False
    lock = threading.Lock()
    out = ""


def _maybe_kill(where: str, stream: Any = None) -> None:
    if not _Kill.armed:
        return
    if not _Kill.lock.acquire(blocking=False):  # another writer thread is killing the process
        time.sleep(3600)
    try:
        if stream is not None and hasattr(stream, "flush"):
            stream.flush()
    except Exception:  # noqa: BLE001
        pass
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_files.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    shards = sorted(f for f in open_files if f.endswith(".distcp"))
    with open(os.path.join(_Kill.out, "kill_marker"), "w") as f:
        f.write(f"rank {rank()} killed itself in {where}\nshard files open: {shards}\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


class _WriteTrap:
    """A file opened for writing: the first ``write`` that returns makes the process kill itself."""

    def __init__(self, f: Any, path: str) -> None:
        self._f, self._path = f, path

    def write(self, data: Any) -> Any:
        n = self._f.write(data)
        _maybe_kill(f"write() to {self._path}", self._f)
        return n

    def __enter__(self) -> "_WriteTrap":
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def install_kill_switch(trainer: pl.Trainer, at: int, out: str) -> None:
    """Rank 1: SIGKILL in the middle of the ``at``-th ``trainer.save_checkpoint``, right after the first
    write into one of its ``.distcp`` files (whatever writes it: every ``open``/``io.open``/``Path.open``
    of a ``.distcp`` file for writing, once armed, hands out a trap)."""
    if rank() != 1:
        return
    import builtins
    import io

    _Kill.out = out
    orig_open = io.open

    def trapped_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = orig_open(file, mode, *args, **kwargs)
        name = str(file if isinstance(file, int) else os.fspath(file))
        if _Kill.armed and any(c in mode for c in "wax+") and name.endswith(".distcp"):
            return _WriteTrap(f, name)
        return f

    builtins.open = io.open = trapped_open  # type: ignore[assignment]
    calls = {"n": 0}
    orig = trainer.save_checkpoint

    def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == at:
            _Kill.armed = True
        return orig(filepath, *args, **kwargs)

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


# ------------------------------------------------------------------ the recorder
class Recorder(pl.Callback):
    def __init__(self, step: dict) -> None:
        self.step = step
        for path in list(step.get("save_at", {}).values()) + ([step["resave"]] if step.get("resave") else []):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.save_at = {int(k): v for k, v in step.get("save_at", {}).items()}
        self.capture_at = set(step.get("capture_at", []))
        self.start_step: Optional[int] = None
        self.start_state: Optional[dict] = None
        self.start_optim: Optional[list] = None
        self.start_sched: Optional[list] = None
        self.captured: dict[int, dict] = {}
        self.mem: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.step.get("record_start"):
            return
        self.start_step = trainer.global_step
        state = full_state(trainer, pl_module)
        self.start_state = state if rank() == 0 else None
        if isinstance(trainer.strategy, DDPStrategy) and rank() == 0:
            self.start_optim = [copy.deepcopy(o.state_dict()) for o in trainer.optimizers]
            self.start_sched = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        if self.step.get("resave"):
            trainer.save_checkpoint(self.step["resave"])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        gs = trainer.global_step
        if gs in self.capture_at and gs not in self.captured:
            state = full_state(trainer, pl_module)
            self.captured[gs] = state if rank() == 0 else {}
        if gs in self.save_at:
            path = self.save_at.pop(gs)
            if self.step.get("track_memory"):
                self._measured_save(trainer, path)
            else:
                trainer.save_checkpoint(path)

    def _measured_save(self, trainer: pl.Trainer, path: str) -> None:
        own = own_partition_bytes(trainer)
        dist.barrier()
        with NewStorageTracker() as tracker:
            trainer.save_checkpoint(path)
        self.mem = {"own_bytes": own, "peak_bytes": tracker.peak_bytes, "total_bytes": tracker.total_bytes,
                    "largest_bytes": tracker.largest_bytes, "ops": tracker.ops, "bucket_bytes": int(BUCKET_MB * 2**20)}
        dist.barrier()
        if self.step["strategy"].startswith("zero3"):  # control: a full gather, measured the same way
            with NewStorageTracker() as tracker:
                assert len(trainer.strategy.full_state_dict()) > 0
            self.mem["gather_peak_bytes"] = tracker.peak_bytes


# ------------------------------------------------------------------ steps
def make_trainer(step: dict, out: str, recorder: Recorder, model_name: str) -> pl.Trainer:
    callbacks: list = [recorder]
    ck = step.get("ckpt")
    if ck:
        callbacks.append(ModelCheckpoint(
            dirpath=ck["dirpath"], every_n_train_steps=ck.get("every"), save_top_k=ck.get("top_k", -1),
            save_last=ck.get("save_last"), monitor=ck.get("monitor"), mode=ck.get("mode", "min"),
        ))
    return pl.Trainer(
        accelerator="cpu",
        devices=world(),
        strategy=make_strategy(step, out),
        precision="32-true",
        max_steps=int(step["steps"]),
        gradient_clip_val=1.0 if model_name == "net" else None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(ck),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )


def _exception_info(exc: BaseException) -> dict[str, Any]:
    corrupt_cls = None
    try:
        from lightning_zero.checkpoint import CorruptCheckpointError as corrupt_cls  # noqa: N813
    except Exception:  # noqa: BLE001
        pass
    return {
        "error": traceback.format_exc(),
        "exc_type": type(exc).__name__,
        "exc_msg": str(exc),
        "exc_corrupt": bool(corrupt_cls is not None and isinstance(exc, corrupt_cls)),
    }


def run_fit(step: dict, out: str) -> dict[str, Any]:
    model_name = step.get("model", "net")
    pl.seed_everything(0, workers=True)
    model = MODELS[model_name]()
    recorder = Recorder(step)
    result: dict[str, Any] = {"error": None}
    trainer = None
    try:
        trainer = make_trainer(step, out, recorder, model_name)
        if step.get("kill_on_save"):
            install_kill_switch(trainer, int(step["kill_on_save"]), out)
        trainer.fit(model, ckpt_path=step.get("resume"))
        if step.get("wait"):
            trainer.strategy.wait_for_checkpoint()
    except Exception as exc:  # noqa: BLE001 - reported by the tests
        result.update(_exception_info(exc))
        print(f"[ckpt rank {rank()}] {step['name']} failed:\n{result['error']}", file=sys.stderr)
    if _Kill.armed:
        result["kill_not_fired"] = True  # armed, but no shard was ever written
    result.update({
        "losses": list(getattr(model, "losses", [])),
        "g_losses": list(getattr(model, "g_losses", [])),
        "d_losses": list(getattr(model, "d_losses", [])),
        "start_step": recorder.start_step,
        "start_state": recorder.start_state,
        "start_optim": recorder.start_optim,
        "start_sched": recorder.start_sched,
        "captured": recorder.captured,
        "mem": recorder.mem,
    })
    ck = step.get("ckpt")
    if ck and os.path.isdir(ck["dirpath"]):
        result["listing"] = sorted(os.listdir(ck["dirpath"]))
    del trainer
    return result


def run_consolidate(step: dict, out: str) -> dict[str, Any]:
    result: dict[str, Any] = {"error": None}
    if rank() == 0:
        try:
            from lightning_zero.checkpoint import consolidate

            consolidate(step["src"], step["dst"])
        except Exception as exc:  # noqa: BLE001
            result.update(_exception_info(exc))
            print(f"[ckpt rank 0] {step['name']} failed:\n{result['error']}", file=sys.stderr)
    return result


def _barrier_or_exit() -> None:
    """After a failed run: continue only once every rank got here (tests/helpers/harness.py)."""
    barrier_or_exit("ckpt", 2 * COLLECTIVE_TIMEOUT_S + 30)  # long enough for a rank blocked in a collective to time out first


@scenario("checkpoint.plan")
def plan(ctx: ScenarioContext) -> None:
    out = str(ctx.out)
    for step in ctx.params["plan"]:
        started = time.perf_counter()
        task = step.get("task", "fit")
        result = run_fit(step, out) if task == "fit" else run_consolidate(step, out)
        if not dist.is_initialized():  # Lightning creates the group in the first fit; else (a failed
            # setup, a plan starting with `consolidate`) the worker's own, for the barriers
            dist.init_process_group("gloo", timeout=timedelta(seconds=2 * COLLECTIVE_TIMEOUT_S + 60))
        result.update({"name": step["name"], "rank": rank(), "world": world(),
                       "seconds": time.perf_counter() - started})
        ctx.record(step["name"], result)
        print(f"[ckpt rank {rank()}] {step['name']}: {'FAILED' if result['error'] else 'ok'} "
              f"({result['seconds']:.1f}s)", file=sys.stderr, flush=True)
        _barrier_or_exit()  # every rank, failed or not (a rank may fail alone, e.g. rank 0 consolidating)

