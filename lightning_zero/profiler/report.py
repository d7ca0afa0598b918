"""The profiler's text report: totals, a module tree, and the top modules per depth (DeepSpeed's layout).

[Note: the peak behind MFU]
MFU divides the achieved FLOP/s of the profiled step by the device's *dense bf16* peak from
``lightning_zero.logging.metrics.PEAK_BF16_FLOPS`` (H100 SXM and H200: 989 TFLOP/s; DESIGN.md
measured 801 TFLOP/s for a large bf16 matmul on an H200, so ~81% MFU is the practical ceiling), the
same table ZeroMetrics uses, so both report the same MFU. ``peak_flops=`` overrides it; on a CPU
or an unknown device no MFU is reported. The profiled step includes the profiler's own overhead (a
Python dispatch per op and two events per module call), so its TFLOP/s are a lower bound of the
unprofiled step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_zero.profiler.modules import ModuleStats, ProfileResult


def human(n: Optional[float], unit: str = "") -> str:
    """1234567 -> '1.23 M' (None -> '-')."""
    if n is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip() if float(n).is_integer() else f"{n:.3g} {unit}".rstrip()


def seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


@dataclass
class StepTotals:
    """The model totals of a profiled step, as logged to TensorBoard."""

    params: int
    fwd_flops: int
    bwd_flops: int
    step_time_s: float
    peak_flops: Optional[float]

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    @property
    def flops_per_s(self) -> Optional[float]:
        return self.flops / self.step_time_s if self.step_time_s > 0 else None

    @property
    def mfu(self) -> Optional[float]:
        fps = self.flops_per_s
        return fps / self.peak_flops if fps is not None and self.peak_flops else None

    def metrics(self, prefix: str = "profiler/") -> dict[str, float]:
        out = {
            f"{prefix}params": float(self.params), f"{prefix}fwd_flops_per_step": float(self.fwd_flops),
            f"{prefix}flops_per_step": float(self.flops), f"{prefix}step_time_s": self.step_time_s,
        }
        if self.flops_per_s is not None:
            out[f"{prefix}tflops_per_device"] = self.flops_per_s / 1e12
        if self.mfu is not None:
            out[f"{prefix}mfu"] = self.mfu
        return out


def _row(m: ModuleStats, total_fwd: int) -> list[str]:
    share = f"{100.0 * m.fwd_flops / total_fwd:.1f}%" if total_fwd else "-"
    fps = m.fwd_flops_per_s
    name = ("  " * m.depth) + (m.name.rsplit(".", 1)[-1] if m.name else "<model>") + f" ({m.type})"
    return [name, human(m.params), human(m.fwd_flops), human(m.fwd_macs), share, seconds(m.fwd_time_s if m.fwd_calls else None),
            seconds(m.bwd_time_s), human(fps, "FLOP/s") if fps else "-"]


HEADER = ["module", "params", "fwd FLOPs", "fwd MACs", "% fwd", "fwd latency", "bwd latency", "fwd FLOP/s"]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def tree_lines(result: ProfileResult, module_depth: int = -1) -> list[str]:
    """One row per module down to ``module_depth`` (-1: all), in module order."""
    keep = [m for m in result.modules if module_depth < 0 or m.depth <= module_depth]
    return _table([HEADER] + [_row(m, result.fwd_flops) for m in keep])


def top_lines(result: ProfileResult, top_modules: int, module_depth: int = -1) -> list[str]:
    """Per depth, the ``top_modules`` modules by forward FLOPs, parameters and forward latency."""
    lines: list[str] = []
    depths = sorted({m.depth for m in result.modules if m.depth > 0 and (module_depth < 0 or m.depth <= module_depth)})
    for d in depths:
        level = [m for m in result.modules if m.depth == d]
        for what, key in (("fwd FLOPs", lambda m: m.fwd_flops), ("params", lambda m: m.params),
                          ("fwd latency", lambda m: m.fwd_time_s)):
            best = sorted(level, key=key, reverse=True)[:top_modules]
            shown = ", ".join(f"{m.name} {human(key(m)) if what != 'fwd latency' else seconds(key(m))}" for m in best)
            lines.append(f"depth {d}, top {top_modules} by {what}: {shown}")
    return lines


def render(
    result: ProfileResult,
    totals: StepTotals,
    title: str,
    module_depth: int = -1,
    top_modules: int = 1,
    stages: Optional[list[tuple[int, StepTotals]]] = None,
) -> str:
    """The full report ([Note: the peak behind MFU] says which peak MFU uses)."""
    fps = totals.flops_per_s
    peak = f"{totals.peak_flops / 1e12:.0f} TFLOP/s dense bf16 peak" if totals.peak_flops else "no known peak"
    lines = [
        title,
        f"params:                    {human(totals.params)} ({totals.params:,})",
        f"forward FLOPs per step:    {human(totals.fwd_flops)} ({human(totals.fwd_flops / 2)} MACs)",
        f"backward FLOPs per step:   {human(totals.bwd_flops)} (gradients and recomputation)",
        f"step time (profiled):      {seconds(totals.step_time_s)} (includes the profiler's overhead)",
        f"achieved:                  {human(fps, 'FLOP/s')}"
        + (f", MFU {100 * totals.mfu:.1f}% of {peak}" if totals.mfu is not None else f" ({peak})"),
        "",
    ]
    if stages and len(stages) > 1:
        lines.append("per pipeline stage:")
        lines += _table([["stage", "params", "fwd FLOPs", "FLOPs", "FLOP/s"]] + [
            [str(s), human(t.params), human(t.fwd_flops), human(t.flops), human(t.flops_per_s, "FLOP/s")] for s, t in stages
        ])
        lines.append("")
    lines += tree_lines(result, module_depth)
    if top_modules > 0:
        lines += [""] + top_lines(result, top_modules, module_depth)
    return "\n".join(lines) + "\n"


__all__ = ["StepTotals", "render", "tree_lines", "top_lines", "human", "seconds"]
