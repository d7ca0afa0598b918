"""pipeline/timing.py: the bubble is measured without the training loop waiting for the device
([Note: measuring the bubble]). CUDA events are stood in for by fake ones that fail if synchronised."""

from __future__ import annotations

import torch

from lightning_zero.pipeline.timing import DeviceReadback, StageTimer


class FakeEvent:
    """A CUDA event recorded at time ``t`` (seconds); ``done`` says whether the device has reached it."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("the training loop waited for the device")

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event's


def _cuda_timer() -> tuple[StageTimer, list[FakeEvent]]:
    timer = StageTimer(torch.device("cpu"))
    timer.cuda = True
    events: list[FakeEvent] = []

    def mark() -> FakeEvent:
        events.append(FakeEvent(float(len(events))))
        return events[-1]

    timer._mark = mark  # type: ignore[method-assign]
    return timer, events


def _step(timer: StageTimer, actions: int) -> None:
    timer.begin_step()
    for _ in range(actions):
        with timer.compute():
            pass
    timer.end_step()


def test_cuda_reads_the_step_before_the_last_without_waiting() -> None:
    timer, events = _cuda_timer()
    _step(timer, 2)  # events 0..5: start, (1, 2), (3, 4), end 5
    assert timer.take() is None  # the step just finished is still queued behind its work: not read
    _step(timer, 1)  # events 6..9
    assert timer.take() is None  # the step before has not completed either: skipped, not waited for


def test_cuda_step_counts_once_its_end_event_completed() -> None:
    timer, events = _cuda_timer()
    _step(timer, 2)
    _step(timer, 1)
    for e in events[:6]:
        e.done = True
    assert timer.take() == (2.0, 5.0)  # busy: (2 - 1) + (4 - 3); span: 5 - 0
    assert timer.take() is None  # once
    _step(timer, 1)  # the device has not reached the end of the step before: that step is not counted
    assert timer.take() is None
    _step(timer, 1)
    assert timer.take() is None  # nor is it read later: its end event is dropped, never waited for


def test_cpu_reads_the_last_step() -> None:
    timer = StageTimer(torch.device("cpu"))
    _step(timer, 3)
    busy, span = timer.take()  # type: ignore[misc]
    assert 0.0 <= busy <= span
    assert timer.take() is None


def test_readback_on_cpu_returns_what_was_put() -> None:
    back = DeviceReadback(torch.device("cpu"))
    back.put(torch.tensor([1.0, 2.5], dtype=torch.float64))
    assert back.get() == [1.0, 2.5]
