"""Measured pipeline bubble: busy time of the compute actions against the span of a pipeline step.

[Note: measuring the bubble]
Each rank times its own compute actions (forward/backward of a micro-batch chunk): on CUDA with
events on the compute stream, so a wait for a received activation shows up as a gap between two
actions; on CPU with the wall clock. A step's span is measured on rank 0 of the pipeline, which
starts first and finishes last (its final backward ends the schedule), so its span is the pipeline's
makespan. The bubble is ``1 - sum(busy over stages) / (P * span)``: the idle fraction of the average
stage, the quantity the formula ``(P - 1) / (M + P - 1)`` predicts for equal stages.

The numbers of a step ride along with the loss all-reduce of a later step (one collective per step
for both), and nothing in the training loop waits for the device: on CUDA a step's events are read at
the end of the step after it (the events of the step just finished are still queued behind its
work: reading them waited for the whole step, as a device synchronisation would), and only once its
end event has completed (else that step is not counted: every rank must report a step for it to
count, runtime.py); the reduced numbers come to the host by an asynchronous copy read at the next
step (:class:`DeviceReadback`; ``.tolist()`` on the device buffer waited for every kernel queued
before it). On CPU a step is timed with the wall clock and read at once.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator, Optional

import torch


class StageTimer:
    """Times this rank's compute actions within a step; ``take()`` returns (busy, span) of a finished step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[object, object]] = []
        self._step_start: Optional[object] = None
        self._step_end: Optional[object] = None
        self._busy = 0.0
        self._ready: Optional[tuple[float, float]] = None
        self._pending: Optional[tuple[object, object, list[tuple[object, object]]]] = None
        """CUDA: the events of the step just finished (read after the next one)."""
        self._older: Optional[tuple[object, object, list[tuple[object, object]]]] = None
        """CUDA: the events of the step before it (what :meth:`take` reads)."""

    def _mark(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin_step(self) -> None:
        self._step_start = self._mark()
        self._events = []
        self._busy = 0.0

    @contextmanager
    def compute(self) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            end = self._mark()
            if self.cuda:
                self._events.append((start, end))
            else:
                self._busy += float(end) - float(start)  # type: ignore[arg-type]

    def end_step(self) -> None:
        end = self._mark()
        if self.cuda:
            self._older, self._pending = self._pending, (self._step_start, end, self._events)
        else:
            self._ready = (self._busy, float(end) - float(self._step_start))  # type: ignore[arg-type]

    def take(self) -> Optional[tuple[float, float]]:
        """(busy seconds, span seconds) of a finished step, once; None when there is none. CPU: the last
        step. CUDA: the step before it, if the device has completed it (never waits: see the note)."""
        if self.cuda:
            older, self._older = self._older, None
            if older is None or not older[1].query():  # type: ignore[attr-defined]
                return None
            start, end, events = older
            busy = sum(s.elapsed_time(e) for s, e in events) / 1e3  # type: ignore[attr-defined]
            return busy, start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]
        out, self._ready = self._ready, None
        return out


LABELS = ("pipe.forward", "pipe.backward", "pipe.exchange")
"""Profiler ranges of the runtime's compute actions and exchanges (benchmarks/pipeline.py --trace splits a stage's
time into compute and communication with them)."""

_NO_LABEL = nullcontext()


def label(name: str) -> AbstractContextManager:
    """A ``record_function`` range named ``name`` while a profiler runs, else a shared no-op: a range costs a
    dispatcher call at entry and exit, host work per micro-batch that an unprofiled step should not pay."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_LABEL


class DeviceReadback:
    """A small device tensor brought to the host without waiting for the device: copied asynchronously
    into pinned memory when put, read (normally a step later, when the copy has long completed) by
    :meth:`get`. On CPU the tensor itself is kept."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._host: Optional[torch.Tensor] = None
        self._event: Optional[object] = None

    def put(self, t: torch.Tensor) -> None:
        """Start bringing ``t`` to the host (the value :meth:`get` returns until the next put)."""
        if not self.cuda:
            self._host = t
            return
        if self._host is None or self._host.shape != t.shape or self._host.dtype != t.dtype:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()  # type: ignore[attr-defined]

    def get(self) -> list[float]:
        """The values last put (waits for their copy only, not for work queued after it)."""
        assert self._host is not None, "put() first"
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
        return self._host.tolist()


class BubbleStats:
    """Rolling window of pipeline-wide (busy, span) sums: the measured bubble fraction."""

    def __init__(self, stages: int, window: int = 20) -> None:
        self.stages = stages
        self._window: deque[tuple[float, float, float]] = deque(maxlen=window)

    def add(self, busy_all_stages: float, local_busy: float, span: float) -> None:
        if span > 0:
            self._window.append((busy_all_stages, local_busy, span))

    @property
    def measured(self) -> Optional[float]:
        """Idle fraction of the average stage over the window (None before two steps have run)."""
        if not self._window:
            return None
        busy = sum(b for b, _, _ in self._window)
        span = sum(s for _, _, s in self._window)
        return min(1.0, max(0.0, 1.0 - busy / (self.stages * span)))

    @property
    def measured_local(self) -> Optional[float]:
        """Idle fraction of this rank's stage over the window."""
        if not self._window:
            return None
        busy = sum(b for _, b, _ in self._window)
        span = sum(s for _, _, s in self._window)
        return min(1.0, max(0.0, 1.0 - busy / span))


__all__ = ["StageTimer", "BubbleStats", "DeviceReadback", "LABELS", "label"]
