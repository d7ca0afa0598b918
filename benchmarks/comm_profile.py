"""``--profile``: a few training steps under ``torch.profiler`` after the timed ones, read back as device
work intervals and handed to overlap.py's interval math ([Note: exposed communication]).

:class:`CommProfiler` is the Callback; :func:`_device_activity` turns a stopped profiler into the
device timeline of one GPU (kernels, memcpy, memset; no annotations, no synchronisation waits).
"""

from __future__ import annotations

import re
import time
import traceback
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from benchmarks.overlap import comm_overlap
from benchmarks.records import short_reason

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

    def _stopped(self) -> tuple[Any, Optional[int]]:
        """Stop the window (for a subclass's ``_stop``): the stopped profiler and this rank's CUDA device index
        (None on CPU). Raises what stopping raised."""
        prof, window, self._prof, self._window = self._prof, self._window, None, None
        self._sync()
        if window is not None:
            window.__exit__(None, None, None)
        prof.stop()
        return prof, self._device.index if self._device is not None and self._device.type == "cuda" else None

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


__all__ = ["CommProfiler", "PROFILE_WINDOW", "DEVICE_WORK", "SYNC_NAME"]
