"""Scenario ``faults.nonfinite`` (tests/faults/scenarios.py; CPU, gloo, 2 ranks) for tests/faults/test_nonfinite.py:
non-finite steps (issue #27 item 3) and failed checkpoint saves (item 4), several cases in one process group.

Params: ``{"plan": [case, ...]}``, cases run in order, each one ``Trainer.fit`` of tests/checkpoint/models.py's
CkptNet (two param groups, AdamW with weight decay, an LR schedule, a frozen layer, tied weights) under
``strategy`` (``zero1``, ``zero2``, ``zero3``, ``zero3_offload``) and ``precision``, with keys:

- ``nan_at``: global steps whose loss is multiplied by NaN on rank 0 only (the reduction spreads it);
- ``zero``: extra ZeroStrategy options (``nonfinite``, ``max_nonfinite_steps``);
- ``snap_at``: a global step around which the full fp32 weights and optimizer states are gathered,
  before it and after it (``same_weights``/``same_state``: bitwise) and after the next (``moved_on``);
- ``ckpt``: a ModelCheckpoint every step, keeping the best 1 by the step number (each new one
  replaces the previous: Lightning deletes the old one after the new save returns);
- ``save_at``: {step: path} ``trainer.save_checkpoint(path)`` after that global step;
- ``enospc``: rank 1's checkpoint writer gets ``OSError(ENOSPC)`` after 4 KiB during the save of
  global step ``enospc`` (the ``open`` of lightning_zero/checkpoint/storage.py is wrapped);
- ``uncaught``: the scenario's exception is not caught (the process must exit non-zero).

Each rank writes ``OUT/<name>.rank<r>.pt``: losses, skipped_steps, the comparisons, warnings logged by
lightning_zero, the exception (type and message), the checkpoint directory's listing.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.checkpoint import storage  # noqa: E402
from tests.checkpoint.models import CkptNet  # noqa: E402
from tests.helpers.worker_io import save_atomic  # noqa: E402

TIMEOUT_S = 60.0


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class NaNNet(CkptNet):
    def __init__(self, nan_at: list[int]) -> None:
        super().__init__()
        self.nan_at = set(nan_at)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("gstep", float(self.trainer.global_step), on_step=True, on_epoch=False)
        if self.trainer.global_step in self.nan_at and self.trainer.global_rank == 0:
            loss = loss * float("nan")
        return loss


def full_state(trainer: pl.Trainer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Full fp32 weights and optimizer states (collective)."""
    s = trainer.strategy
    weights = {k: v.detach().cpu().clone() for k, v in s.full_state_dict().items() if torch.is_tensor(v)}
    return weights, [s._full_optimizer_state(o)["state"] for o in s.optimizers]


def same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Recorder(pl.Callback):
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.snap_at = spec.get("snap_at")
        self.save_at = {int(k): v for k, v in spec.get("save_at", {}).items()}
        self.before: Any = None
        self.out: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        gs = trainer.global_step  # steps done: the state before step ``gs`` runs
        if self.snap_at is not None and gs in (self.snap_at, self.snap_at + 1, self.snap_at + 2):
            state = full_state(trainer)
            if gs == self.snap_at:
                self.before = state
            elif gs == self.snap_at + 1:
                self.out["same_weights"] = same(self.before[0], state[0])
                self.out["same_state"] = same(self.before[1], state[1])
                self.out["state_tensors"] = sum(len(st) for st in state[1])
                self.out["finite_after"] = all(bool(torch.isfinite(v).all()) for v in state[0].values()
                                               if v.is_floating_point())
            else:
                self.out["moved_on"] = not same(self.before[0], state[0])
        self.out.setdefault("skipped", {})[trainer.global_step] = trainer.strategy.skipped_steps
        if trainer.global_step in self.save_at:
            weights = full_state(trainer)[0]  # collective
            self.out.setdefault("weights_at", {})[trainer.global_step] = weights if rank() == 0 else None
            trainer.save_checkpoint(self.save_at.pop(trainer.global_step))


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def inject_enospc(after_bytes: int) -> None:
    """Rank 1's checkpoint files: ``OSError(ENOSPC)`` once ``after_bytes`` were written (some data lands
    first, as on a file system that fills mid-write)."""
    written = {"n": 0}

    class Full:
        def __init__(self, f: Any) -> None:
            self._f = f

        def write(self, data: Any) -> int:
            n = memoryview(data).nbytes
            if written["n"] + n > after_bytes:
                self._f.write(memoryview(data).cast("B")[: max(0, after_bytes - written["n"])])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written["n"] += n
            return self._f.write(data)

        def __enter__(self) -> "Full":
            self._f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._f.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

    storage.open = lambda *a, **k: Full(open(*a, **k))  # type: ignore[attr-defined]


def make_trainer(spec: dict[str, Any], recorder: Recorder) -> pl.Trainer:
    base, _, offload = spec["strategy"].partition("_")
    kwargs: dict[str, Any] = {"stage": int(base[-1]), "bucket_size_mb": 0.01, "timeout_s": TIMEOUT_S}
    if kwargs["stage"] == 3:
        kwargs["param_persistence_threshold"] = 0
    if offload == "offload":
        kwargs.update(offload_optimizer="cpu", offload_params="cpu")
    kwargs.update(spec.get("zero", {}))
    callbacks: list[Any] = [recorder]
    if spec.get("ckpt"):
        callbacks.append(ModelCheckpoint(dirpath=spec["ckpt"], every_n_train_steps=1, save_top_k=1, monitor="gstep",
                                         mode="max", filename="{step}"))
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_zero.ZeroStrategy(**kwargs),
        precision=spec.get("precision", "32-true"), max_steps=int(spec["steps"]), limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=bool(spec.get("ckpt")), enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
    )


def run(spec: dict[str, Any]) -> dict[str, Any]:
    pl.seed_everything(0, workers=True)
    model = NaNNet(spec.get("nan_at", []))
    recorder = Recorder(spec)
    handler = Warnings()
    logging.getLogger("lightning_zero").addHandler(handler)
    result: dict[str, Any] = {"exc_type": None, "exc_msg": None}
    orig_open = storage.__dict__.get("open")
    trainer = make_trainer(spec, recorder)
    if spec.get("enospc") is not None and rank() == 1:
        orig_save = trainer.save_checkpoint

        def save(path: Any, *a: Any, **k: Any) -> Any:
            if trainer.global_step == int(spec["enospc"]):
                inject_enospc(4096)
            return orig_save(path, *a, **k)

        trainer.save_checkpoint = save  # type: ignore[method-assign]
    try:
        try:
            trainer.fit(model)
        finally:
            logging.getLogger("lightning_zero").removeHandler(handler)
            if orig_open is None:
                storage.__dict__.pop("open", None)
    except Exception as exc:  # noqa: BLE001 - reported by the tests
        if spec.get("uncaught"):
            raise
        result.update(exc_type=type(exc).__name__, exc_msg=str(exc), error=traceback.format_exc())
    result.update(recorder.out, losses=list(model.losses), warnings=handler.lines,
                  skipped_steps=trainer.strategy.skipped_steps)
    for key in ("ckpt", "dir"):
        d = spec.get(key)
        if d and os.path.isdir(d):
            result.setdefault("listing", {})[d] = sorted(os.listdir(d))
    return result


def run_plan(out: str, plan: list[dict[str, Any]]) -> None:
    for spec in plan:
        result = run(spec)
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
        save_atomic(result, os.path.join(out, f"{spec['name']}.rank{rank()}.pt"))
        print(f"[nonfinite rank {rank()}] {spec['name']}: {result['exc_type'] or 'ok'}", file=sys.stderr, flush=True)
        dist.monitored_barrier(timeout=timedelta(seconds=2 * TIMEOUT_S), wait_all_ranks=True)

