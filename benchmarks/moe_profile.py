"""``moe.py --profile``: where an MoE step's time goes on the device, beside the dense model's.

Why: at EP 2 on 2 H200s MoE ran at 0.69x dense tokens/s with a balanced routing and an all-to-all share of
4-7% (RESULTS.md 2026-11-29 20:27), so the missing 25% is elsewhere: the experts' matmuls, the dispatch, the
optimizer over 2.5G parameters per rank, or the host. :class:`KernelProfiler` profiles two steps after the
timed ones (:class:`comm_profile.CommProfiler`'s window, every rank) and reports, for this rank's GPU:
the window's wall time, the device's busy time (the union of its work intervals: the rest is the device
waiting for the host or a peer), and the device time per kernel category and of the top kernels.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

from benchmarks.comm_profile import CommProfiler, _device_activity
from benchmarks.records import short_reason

CATEGORIES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|wgmma", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("routing (sort, scatter, index, cumsum, topk)", re.compile(r"sort|scatter|index|gather|cumsum|scan|topk|"
                                                                 r"one_hot|radix|nonzero|bincount", re.I)),
    ("copies and fills", re.compile(r"memcpy|memset|copy|fill|cat|Memcpy|Memset", re.I)),
    ("reductions", re.compile(r"reduce", re.I)),
)
"""Kernel name patterns, first match wins; the rest is 'elementwise and other'."""


def busy_us(kernels: list[tuple[str, float, float]]) -> float:
    """The union of the work intervals: the time the device had something running."""
    total, end = 0.0, float("-inf")
    for _, s, e in sorted(kernels, key=lambda k: k[1]):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def categorise(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, s, e in kernels:
        cat = next((c for c, pattern in CATEGORIES if pattern.search(name)), "elementwise and other")
        out[cat] = out.get(cat, 0.0) + (e - s)
    return out


class KernelProfiler(CommProfiler):
    """Two steps after ``start_after`` under torch.profiler; ``result``: the figures of the module docstring."""

    def __init__(self, start_after: int, steps: int = 2) -> None:
        super().__init__(start_after, steps=steps)

    def _stop(self) -> None:  # type: ignore[override]
        try:
            prof, index = self._stopped()
            kernels, span, _, notes = _device_activity(prof, index)
            wall = (span[1] - span[0]) if span else (max(e for *_, e in kernels) - min(s for _, s, _ in kernels))
            per_name: dict[str, list[float]] = {}
            for name, s, e in kernels:
                row = per_name.setdefault(name[:90], [0.0, 0])
                row[0] += e - s
                row[1] += 1
            top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:15]
            steps = max(1, self._profiled)
            self.result = {
                "profiled_steps": self._profiled, "wall_ms_per_step": wall / 1e3 / steps,
                "busy_ms_per_step": busy_us(kernels) / 1e3 / steps,
                "category_ms_per_step": {k: v / 1e3 / steps for k, v in
                                         sorted(categorise(kernels).items(), key=lambda kv: -kv[1])},
                "top_kernels": [(name, round(t / 1e3 / steps, 3), int(n) // steps) for name, (t, n) in top],
            }
            if notes:
                self.result["note"] = "; ".join(notes)
        except Exception as exc:  # noqa: BLE001 - a profiler failure is a note, never a failed row
            traceback.print_exc()
            self.result = {"note": f"profile failed: {short_reason(exc)}"}


def profile_table(result: dict[str, Any]) -> str:
    """The result as markdown (rank 0 prints it under the record's row)."""
    if "wall_ms_per_step" not in result:
        return f"profile: {result.get('note', 'no result')}"
    lines = [f"profile, per step over {result['profiled_steps']} steps: wall {result['wall_ms_per_step']:.1f} ms, "
             f"device busy {result['busy_ms_per_step']:.1f} ms", "", "| category | device ms / step |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in result["category_ms_per_step"].items()]
    lines += ["", "| kernel | ms / step | launches / step |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {ms:.2f} | {n} |" for name, ms, n in result["top_kernels"]]
    return "\n".join(lines)
