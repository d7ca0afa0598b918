"""Exposed communication from a profiler's device timeline: pure interval math (no torch).

Used by ``comm_profile.py`` (``peers_worker.py --profile``); unit-tested on synthetic intervals in
``tests/unit/test_overlap.py``.

[Note: exposed communication] Over a profiled window of W microseconds of one device's timeline:

* ``comm``  = the union of the intervals of communication kernels (NCCL: a name containing "nccl",
  case-insensitive, which covers ``ncclDevKernel_*`` and ``ncclKernel_*``);
* ``other`` = the union of every other device activity (compute kernels, and memcpy/memset, which
  keep the device busy just as well);
* ``exposed`` = ``comm`` minus its overlap with ``other``: the time the device did nothing but
  communicate (or wait inside a collective for its peer).

``exposed / W`` is the communication the strategy failed to hide behind compute; ``comm / W`` is how
much there was in all; ``(comm - exposed) / W`` was hidden. Concurrent communication kernels (two
streams) count once: it is a union, not a sum. Intervals are clipped to the window.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

Interval = tuple[float, float]

COMM_KERNEL = re.compile(r"nccl", re.IGNORECASE)
"""What makes a device kernel a communication kernel (``ncclDevKernel_AllGather_RING_LL``,
``ncclKernel_ReduceScatter_...``, ``ncclDevKernel_SendRecv``...)."""


def is_comm_kernel(name: str) -> bool:
    return COMM_KERNEL.search(name) is not None


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals (empty and reversed ones are dropped;
    touching ones are joined)."""
    spans = sorted((float(s), float(e)) for s, e in intervals if e > s)
    out: list[list[float]] = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(merged: Sequence[Interval]) -> float:
    """Total length of disjoint intervals (the output of :func:`merge`)."""
    return sum(e - s for s, e in merged)


def overlap_length(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two unions, each given as sorted disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


@dataclass(frozen=True)
class CommOverlap:
    """One device's communication over a profiled window; times in microseconds."""

    wall_us: float
    comm_us: float
    """Union of communication kernels."""
    exposed_us: float
    """Part of ``comm_us`` with no other device activity running."""
    busy_us: float
    """Union of all device activity (communication or not)."""
    n_comm: int
    n_other: int

    @property
    def hidden_us(self) -> float:
        return self.comm_us - self.exposed_us

    @property
    def exposed_fraction(self) -> Optional[float]:
        """Exposed communication / wall time of the window (None when nothing ran on the device)."""
        return self.exposed_us / self.wall_us if self.wall_us > 0 and self.n_comm + self.n_other else None

    @property
    def comm_fraction(self) -> Optional[float]:
        """All communication (hidden or not) / wall time of the window."""
        return self.comm_us / self.wall_us if self.wall_us > 0 and self.n_comm + self.n_other else None

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "hidden_us": self.hidden_us,
            "exposed_fraction": self.exposed_fraction,
            "comm_fraction": self.comm_fraction,
        }


def comm_overlap(kernels: Iterable[tuple[str, float, float]], window: Optional[Interval] = None) -> CommOverlap:
    """Exposed and total communication of device activity ``(name, start, end)`` over ``window``.

    Without a window, the span from the first start to the last end of the activity is used (a
    fallback: it leaves out host time before the first and after the last kernel).
    """
    comm_raw: list[Interval] = []
    other_raw: list[Interval] = []
    for name, start, end in kernels:
        (comm_raw if is_comm_kernel(name) else other_raw).append((float(start), float(end)))
    if window is None:
        everything = comm_raw + other_raw
        window = (min(s for s, _ in everything), max(e for _, e in everything)) if everything else (0.0, 0.0)
    comm_in = clip(comm_raw, window)
    other_in = clip(other_raw, window)
    comm = merge(comm_in)
    other = merge(other_in)
    comm_us = length(comm)
    return CommOverlap(
        wall_us=max(0.0, window[1] - window[0]),
        comm_us=comm_us,
        exposed_us=comm_us - overlap_length(comm, other),
        busy_us=length(merge(comm + other)),
        n_comm=len(comm_in),
        n_other=len(other_in),
    )


__all__ = ["CommOverlap", "comm_overlap", "is_comm_kernel", "merge", "length", "overlap_length", "clip"]
