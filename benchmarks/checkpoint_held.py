"""``checkpoint_worker.py --held-steps K``: what a save costs the training that goes on beside it.

[Note: training held by a save]
After ``--steps`` + K steps and again after ``--steps`` + 3K, one save from inside the loop (the first pays
one-time costs: the second is the figure). Every step is timed against the training stream at both ends
(a device-wide synchronisation would also wait for an async save's side stream, which a training loop
never does), so the K steps after a save show what it costs the training beside it: an async save's
device copies, its fence before the next optimizer step, its writer threads on the host. held = the
caller's blocked time + the K steps after - K x the mean of the K steps before. The first save's write
is waited for, untimed, K steps before the second, and its files deleted (two 8B checkpoints of 2 ranks
do not fit a 128 GiB disk: ENOSPC on 2026-11-29).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def sync_training(device: torch.device) -> None:
    """The training stream only (see the Note)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HeldBySave(Callback):
    """The in-loop saves and step times of the Note; ``record(kind, **fields)`` writes a result line,
    ``delete(trainer, path)`` removes a checkpoint (collective)."""

    def __init__(self, held_steps: int, steps: int, root: Path, is_async: bool,
                 record: Callable[..., None], delete: Callable[[Trainer, Path], None]) -> None:
        self.k, self.steps, self.root, self.is_async = held_steps, steps, root, is_async
        self.record, self.delete = record, delete
        self.step_s: list[float] = []
        """Every training step's wall time, synchronised on the training stream."""
        self.saves: list[dict[str, Any]] = []
        """Per in-loop save: the steps timed when it ran, its blocked time, path, staging."""
        self._t0 = 0.0
        self.frees: list[tuple[int, int]] = []
        """Per step, the caching allocator's (failed-malloc retries, cudaFree calls) so far: either
        synchronises the device, so waits for an async save's side stream too."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        sync_training(trainer.strategy.root_device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        sync_training(trainer.strategy.root_device)
        self.step_s.append(time.perf_counter() - self._t0)
        device = trainer.strategy.root_device
        stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        self.frees.append((stats.get("num_alloc_retries", 0), stats.get("num_device_free", 0)))
        if trainer.global_step in (self.steps + self.k, self.steps + 3 * self.k):
            self._save(trainer)
        elif trainer.global_step == self.steps + 2 * self.k:  # untimed: the first write ends, its files go
            if self.is_async:
                trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
            self.delete(trainer, self.saves[0]["path"])

    def _save(self, trainer: Trainer) -> None:
        path = self.root / f"in_loop{len(self.saves) + 1}"
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier("ckpt_bench.in_loop")
        sync_training(trainer.strategy.root_device)
        t0 = time.perf_counter()
        trainer.save_checkpoint(path)
        checkpointer = getattr(trainer.strategy, "checkpointer", None)
        self.saves.append({"at": len(self.step_s), "blocking_s": time.perf_counter() - t0, "path": path,
                           "staged_on": getattr(checkpointer, "staged_on", None)})

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.is_async and self.saves:
            trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        for index, save in enumerate(self.saves, 1):
            at, k = save["at"], self.k
            before, after = self.step_s[at - k : at], self.step_s[at : at + k]
            mean = sum(before) / len(before)
            held = save["blocking_s"] + sum(after) - len(after) * mean
            end = min(at + k, len(self.frees)) - 1
            retries, frees = (self.frees[end][i] - self.frees[at - 1][i] for i in (0, 1))
            self.record("held", index=index, blocking_s=save["blocking_s"], before_s=before, after_s=after,
                        held_s=held, step_s=mean, held_steps=held / mean, staged_on=save["staged_on"],
                        alloc_retries_after=retries, device_frees_after=frees)
        if self.saves:
            self.delete(trainer, self.saves[-1]["path"])  # the first is gone already
