"""Scenario ``faults.plan`` (tests/faults/scenarios.py imports this module in the launched processes only) for the
fault-injection tests (issue #14): one ``Trainer.fit`` (or a short plan of them) on 2 CPU/gloo ranks with one
injected fault, under ``torchrun`` or Lightning's own launcher (tests/faults/launch.py; the harness's
``launcher="python"``: ``Trainer(devices=2)`` then starts rank 1 itself).

Params: ``{"plan": [fit, ...]}``, fits run in order in one process group; each is a dict:

* ``name``; ``strategy``: ``zero2``, ``zero3``, ``zero3_offload`` (offload_optimizer/params "cpu") or
  ``zero3_offload_nvme`` (both "nvme", ``nvme_path`` = ``OUT/nvme``); ``steps`` (max_steps);
* ``fault``: ``None``, ``train_step`` (rank 1 raises in ``training_step`` at global step ``at``),
  ``batch_end`` (rank 1 raises in a callback's ``on_train_batch_end`` once global step ``at`` is done,
  i.e. after that optimizer step), ``nvme_eio`` / ``nvme_enospc`` (from global step ``at`` on, rank 1's
  NVMe I/O threads, the ``lz-nvme*`` pool that runs ``seg_write``/``seg_read`` of
  lightning_zero/offload/nvme.py, see ``os.pwritev``/``os.preadv`` raise ``OSError(EIO)`` on their
  ``after``-th call, resp. ``OSError(ENOSPC)`` once ``after`` bytes were written), ``bad_lr`` (every rank:
  AdamW(lr=-1) raises in ``configure_optimizers``), ``sigkill`` (rank 1 SIGKILLs itself in
  ``on_before_optimizer_step`` at global step ``at``); with ``slow_cleanup``, rank 0's file removals
  take 0.5 s each from global step ``at`` on (see ``_slow_file_removal``);
* ``ckpt``: a ModelCheckpoint in that directory (``every`` = every_n_train_steps, ``save_last=True``);
  ``resume``: ``ckpt_path`` for fit (e.g. ``"last"``);
* ``batches``: per-rank training loader lengths (e.g. ``[5, 7]``: no distributed sampler, uneven
  inputs, issue #27 item 7); ``val_batches``: per-rank validation loader lengths (validation runs at
  each epoch's end); ``epochs``: max_epochs (``steps`` -1: the epochs decide).

Every line a rank writes through ``sys.stdout``/``sys.stderr`` (tracebacks, logging, prints) is
prefixed ``[r<rank>] `` and written whole (one ``write(2)``), so that the tests can tell which rank
printed what even when both print at once. Each rank writes ``OUT/pid.rank<R>`` at start,
``OUT/<name>.rank<R>.json`` from a ``finally`` after each fit (exception, losses, the non-daemon
threads still alive, swap files left) and ``OUT/atexit.rank<R>`` from an ``atexit`` handler (reached
only when interpreter shutdown got past joining the non-daemon threads).
"""

from __future__ import annotations

import atexit
import errno
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any


def _start_rank() -> int:
    """This process's rank before any Trainer exists: torchrun sets RANK, Lightning's launcher sets
    LOCAL_RANK in the processes it starts; its own main process is rank 0."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


RANK = _start_rank()
TAG = f"[r{RANK}] "


class _Tagged(io.TextIOBase):
    """A text stream that writes whole lines, each prefixed with this rank's tag, straight to ``fd``."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = ""

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._emit(line + "\n")
        return len(s)

    def _emit(self, text: str) -> None:
        data = (TAG + text).encode("utf-8", "replace")
        while data:
            try:
                n = os.write(self._fd, data)
            except InterruptedError:
                continue
            except OSError:
                return
            data = data[n:]

    def flush(self) -> None:
        if self._buf:
            line, self._buf = self._buf, ""
            self._emit(line + "\n")

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


# Imported only by the scenario in a launched process (the tests import nothing from here): its output is
# tagged from here on, before Lightning's imports make their log handlers (which keep the stream they see).
sys.stdout = _Tagged(1)  # type: ignore[assignment]
sys.stderr = _Tagged(2)  # type: ignore[assignment]

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_zero  # noqa: E402
from tests.checkpoint.models import CkptNet  # noqa: E402
from tests.faults.messages import fault_message  # noqa: E402
from tests.helpers.parity_runs import offload_kwargs  # noqa: E402

COLLECTIVE_TIMEOUT_S = 120.0
"""The strategy's collective timeout: a rank that waits for a dead peer until then overruns the
tests' 60 s limit, so a hang shows as a test timeout rather than as a late, 'clean' exit."""
# ------------------------------------------------------------------------------------------ faults
OUT = ""


def mark_fault(what: str) -> None:
    """``OUT/fault_time``: when the (first) fault fired; the tests give every process 60 s from then."""
    if not OUT:
        return
    path = Path(OUT, "fault_time")
    if path.exists():
        return
    # every rank may fire at once (bad_lr): write a private file, then link it into place, which fails
    # when another rank was first; the reader never sees two writes interleaved or a half-written file
    mine = Path(OUT, f"fault_time.rank{RANK}")
    mine.write_text(json.dumps({"time": time.time(), "what": what, "rank": RANK}))
    try:
        os.link(mine, path)
    except FileExistsError:
        pass
    finally:
        mine.unlink()


class _NvmeIoFault:
    """Wraps ``os.pwritev``/``os.preadv`` (what nvme.py's segment functions call in the ``lz-nvme``
    thread pool); armed from global step ``at`` on, calls from those threads fail."""

    def __init__(self, kind: str, after: int) -> None:
        self.kind, self.after = kind, after
        self.armed = False
        self.calls = 0
        self.bytes = 0
        self.fired = 0
        self.thread_calls = 0
        self.lock = threading.Lock()
        orig_w, orig_r = os.pwritev, os.preadv

        def pwritev(fd: int, buffers: Any, offset: int, *a: Any) -> int:
            self._check(sum(memoryview(b).nbytes for b in buffers), write=True)
            return orig_w(fd, buffers, offset, *a)

        def preadv(fd: int, buffers: Any, offset: int, *a: Any) -> int:
            self._check(0, write=False)
            return orig_r(fd, buffers, offset, *a)

        os.pwritev, os.preadv = pwritev, preadv  # type: ignore[assignment]

    def _check(self, nbytes: int, write: bool) -> None:
        if not threading.current_thread().name.startswith("lz-nvme"):
            return
        with self.lock:
            self.thread_calls += 1
            if not self.armed:
                return
            self.calls += 1
            if write:
                self.bytes += nbytes
            if self.kind == "nvme_eio" and self.calls >= self.after:
                self.fired += 1
                mark_fault("nvme_eio")
                raise OSError(errno.EIO, fault_message("nvme_eio", 0))
            if self.kind == "nvme_enospc" and write and self.bytes > self.after:
                self.fired += 1
                mark_fault("nvme_enospc")
                raise OSError(errno.ENOSPC, f"No space left on device ({fault_message('nvme_enospc', 0)})")


def _slow_file_removal(delay: float = 0.5) -> None:
    """Every later ``os.unlink``/``os.rmdir`` of this process takes ``delay`` seconds longer: a
    surviving rank's cleanup (removing its swap files) then takes seconds, as on a slow or busy disk,
    and whatever its launcher does meanwhile (torchrun's SIGTERM, Lightning's SIGKILL of every
    process) happens in the middle of it."""
    if getattr(os.unlink, "_slow", False):
        return
    orig_unlink, orig_rmdir = os.unlink, os.rmdir

    def unlink(*a: Any, **k: Any) -> Any:
        time.sleep(delay)
        return orig_unlink(*a, **k)

    def rmdir(*a: Any, **k: Any) -> Any:
        time.sleep(delay)
        return orig_rmdir(*a, **k)

    unlink._slow = True  # type: ignore[attr-defined]
    os.unlink, os.rmdir = unlink, rmdir  # type: ignore[assignment]


class Faults(pl.Callback):
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.kind = spec.get("fault")
        self.at = int(spec.get("at", 2))
        self.io: _NvmeIoFault | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.kind in ("nvme_eio", "nvme_enospc") and trainer.global_rank == 1 and self.io is None:
            self.io = _NvmeIoFault(self.kind, int(self.spec.get("after", 1)))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.io is not None and trainer.global_step >= self.at:
            self.io.armed = True
        if self.spec.get("slow_cleanup") and trainer.global_rank == 0 and trainer.global_step >= self.at:
            _slow_file_removal()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.kind == "batch_end" and trainer.global_rank == 1 and trainer.global_step == self.at:
            mark_fault("batch_end")
            raise RuntimeError(fault_message("batch_end", self.at))

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        victim = int(self.spec.get("kill_rank", 1))
        if self.kind == "sigkill" and trainer.global_rank == victim and trainer.global_step == self.at:
            sys.stdout.flush()
            sys.stderr.flush()
            mark_fault("sigkill")
            Path(self.spec["out"], "sigkill_marker").write_text(f"rank {victim} SIGKILLed itself at step {self.at}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def report(self) -> dict:
        if self.io is None:
            return {}
        return {"io_armed": self.io.armed, "io_calls_after_arm": self.io.calls, "io_fired": self.io.fired,
                "io_thread_calls": self.io.thread_calls, "io_bytes_after_arm": self.io.bytes}


class FaultNet(CkptNet):
    """CkptNet (tests/checkpoint/models.py: global step s always trains on the same fixed global batch)."""

    def __init__(self, fault: str | None = None, at: int = 2, lr: float = 3e-3, batches: list[int] | None = None,
                 val_batches: list[int] | None = None) -> None:
        super().__init__(lr=lr)
        self.fault, self.at = fault, at
        self.batches, self.val_batches = batches, val_batches

    def train_dataloader(self) -> Any:
        if self.batches is None:
            return super().train_dataloader()
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(torch.arange(self.batches[self.trainer.global_rank])), batch_size=1)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(torch.arange((self.val_batches or [0, 0])[self.trainer.global_rank])),
                          batch_size=1)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        rows = self.data[batch[0] % self.data.shape[0]]
        return self(rows[:, :-1]).float().mean()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fault == "train_step" and self.trainer.global_rank == 1 and self.trainer.global_step == self.at:
            mark_fault("train_step")
            raise RuntimeError(fault_message("train_step", self.at))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        if self.fault == "bad_lr":
            mark_fault("bad_lr")
        return super().configure_optimizers()


# ------------------------------------------------------------------------------------------ the run
def make_strategy(spec: dict, out: str) -> lightning_zero.ZeroStrategy:
    base, _, offload = spec["strategy"].partition("_")
    kwargs: dict[str, Any] = {"stage": int(base[-1]), "bucket_size_mb": 0.01, "timeout_s": COLLECTIVE_TIMEOUT_S}
    if kwargs["stage"] == 3:
        kwargs["param_persistence_threshold"] = 0
    if offload == "offload":
        kwargs.update(offload_kwargs({"oopt": "cpu", "oparams": "cpu"}))
    elif offload == "offload_nvme":
        nvme = os.path.join(out, "nvme")
        os.makedirs(nvme, exist_ok=True)
        kwargs.update(offload_kwargs({"oopt": "nvme", "oparams": "nvme", "nvme": nvme}))
    elif offload:
        raise ValueError(f"unknown strategy {spec['strategy']!r}")
    return lightning_zero.ZeroStrategy(**kwargs)


def live_threads() -> tuple[list[str], list[str]]:
    """(non-daemon threads other than this one that are alive, every thread's name)."""
    me = threading.current_thread()
    threads = threading.enumerate()
    return ([t.name for t in threads if t is not me and not t.daemon and t.is_alive()],
            [f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threads])


def swap_files(out: str) -> list[str]:
    """Swap files under the run's NVMe root now. Another rank may be removing its own swap directory
    while this one looks (CI, 2026-11-23: ``rglob`` raised on a directory that vanished mid-walk);
    ``os.walk`` skips what is gone."""
    root = Path(out, "nvme")
    return sorted(str(Path(d, f).relative_to(root)) for d, _, files in os.walk(root) for f in files if f.endswith(".swap"))


def run_fit(spec: dict, out: str) -> None:
    spec = dict(spec, out=out)
    kind = spec.get("fault")
    at = int(spec.get("at", 2))
    started = time.perf_counter()
    pl.seed_everything(0, workers=True)
    model = FaultNet(kind, at, lr=-1.0 if kind == "bad_lr" else 3e-3, batches=spec.get("batches"),
                     val_batches=spec.get("val_batches"))
    faults = Faults(spec)
    callbacks: list[Any] = [faults]
    ck = spec.get("ckpt")
    if ck:
        callbacks.append(ModelCheckpoint(dirpath=ck["dirpath"], every_n_train_steps=int(ck["every"]), save_top_k=-1,
                                         save_last=True))
    report: dict[str, Any] = {"name": spec["name"], "rank": RANK, "pid": os.getpid(), "exc_type": None, "exc_msg": None}
    trainer = None
    try:
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=make_strategy(spec, out), precision="32-true",
            max_steps=int(spec.get("steps", 4)), max_epochs=spec.get("epochs"), gradient_clip_val=1.0,
            limit_val_batches=1.0 if spec.get("val_batches") else 0, num_sanity_val_steps=0,
            logger=False, enable_checkpointing=bool(ck), enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, callbacks=callbacks,
        )
        trainer.fit(model, ckpt_path=spec.get("resume"))
    except BaseException as exc:
        report.update(exc_type=type(exc).__name__, exc_msg=str(exc)[:2000], exc_tb=traceback.format_exc()[-6000:])
        raise
    finally:
        nondaemon, names = live_threads()
        report.update(
            rank=trainer.global_rank if trainer is not None else RANK,
            nondaemon_threads=nondaemon, threads=names, swap_files=swap_files(out),
            losses=list(model.losses), seconds=time.perf_counter() - started, **faults.report(),
        )
        with open(os.path.join(out, f"{spec['name']}.rank{report['rank']}.json"), "w") as f:
            json.dump(report, f, indent=1)


def run_plan(out: str, plan: list[dict[str, Any]]) -> None:
    global OUT
    OUT = out
    Path(out, f"pid.rank{RANK}").write_text(str(os.getpid()))
    atexit.register(lambda: Path(out, f"atexit.rank{RANK}").write_text(f"{live_threads()[1]}\n"))
    for spec in plan:
        run_fit(spec, out)
