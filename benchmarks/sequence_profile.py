"""``sequence.py sp --profile``: the communication share of a sequence-parallel step, from a torch.profiler
trace of one step after the timed ones, for our worker (a Lightning callback) and DeepSpeed's (a context).

Two shares of the profiled window's wall time, each total and exposed (overlap.py [Note: exposed
communication]: exposed = communication kernels running with no other device work):

* ``nccl``: every NCCL kernel (ZeRO-3's gathers and reduce-scatters, and SP's exchanges);
* ``sp``: sequence parallelism's own, the all-to-all and point-to-point kernels (NCCL runs all-to-all as
  grouped send/receive: ``ncclDevKernel_SendRecv``; ring attention's exchanges are the same kernels); the
  other NCCL kernels are left out of that analysis altogether (neither communication nor compute).
"""

from __future__ import annotations

import re
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from benchmarks.comm_profile import PROFILE_WINDOW, CommProfiler, _device_activity
from benchmarks.overlap import comm_overlap, is_comm_kernel
from benchmarks.records import short_reason

SP_KERNEL = re.compile(r"sendrecv|alltoall|all_to_all", re.IGNORECASE)
"""NCCL kernels of sequence parallelism's exchanges."""


def analyse(prof: Any, device_index: Optional[int]) -> dict[str, Any]:
    """The two shares (see the module docstring) of a stopped profiler's window."""
    kernels, span, _, notes = _device_activity(prof, device_index)
    nccl = comm_overlap(kernels, span)
    sp = comm_overlap([k for k in kernels if not is_comm_kernel(k[0]) or SP_KERNEL.search(k[0])], span)
    out: dict[str, Any] = {
        "wall_us": nccl.wall_us, "nccl_us": nccl.comm_us, "nccl_fraction": nccl.comm_fraction,
        "nccl_exposed_fraction": nccl.exposed_fraction, "sp_us": sp.comm_us, "sp_fraction": sp.comm_fraction,
        "sp_exposed_fraction": sp.exposed_fraction,
    }
    if not kernels:
        notes.append("no CUDA kernel events" + (" (CPU run)" if device_index is None else ""))
    if notes:
        out["note"] = "; ".join(notes)
    return out


class SeqCommProfiler(CommProfiler):
    """:class:`comm_profile.CommProfiler` (one step after ``start_after``) with :func:`analyse`'s figures."""

    def __init__(self, start_after: int) -> None:
        super().__init__(start_after, steps=1)

    def _stop(self) -> None:  # type: ignore[override]
        try:
            prof, index = self._stopped()
            self.result = {**analyse(prof, index), "steps": self._profiled}
        except Exception as exc:  # noqa: BLE001 - a profiler failure is a note, never a failed row
            traceback.print_exc()
            self.result = {"note": f"profile failed: {short_reason(exc)}"}


@contextmanager
def profiled(device: torch.device, into: dict[str, Any]) -> Iterator[None]:
    """Profile the block (one training step of a loop without Lightning); ``into`` receives :func:`analyse`'s
    figures, or a note."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False)
    if cuda:
        torch.cuda.synchronize(device)
    prof.start()
    try:
        with record_function(PROFILE_WINDOW):
            yield
            if cuda:
                torch.cuda.synchronize(device)
    finally:
        prof.stop()
    try:
        into.update({**analyse(prof, device.index if cuda else None), "steps": 1})
    except Exception as exc:  # noqa: BLE001
        into["note"] = f"profile analysis failed: {short_reason(exc)}"


__all__ = ["SeqCommProfiler", "analyse", "profiled", "SP_KERNEL"]
