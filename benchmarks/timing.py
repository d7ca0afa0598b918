"""The step timer every GPU benchmark worker shares: wall time per training step, device synchronised at
each step boundary, warm-up steps dropped, peak device memory read at the end of the timed steps.

A Lightning ``Callback`` for Trainer workers (peers_worker.py, compile_worker.py, tp_worker.py,
lora_worker.py, checkpoint_worker.py); fabric_worker.py drives the same hooks from its own loop.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


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


__all__ = ["StepTimer"]
