"""Turn the peer benchmark's JSON lines into rows, a markdown table and the issues' target checks.

Pure Python (no torch), so ``peers.py --from-results FILE`` can re-render a run's table anywhere,
e.g. here after fetching the results file back from the GPU machine.

[Note: aggregating ranks] A step ends when its slowest rank ends, so a configuration's step time
is, per timed step, the maximum over ranks, and the reported figure is the median of those maxima
(robust to one slow step: a garbage collection, a page fault). Tokens/s are global: the tokens of
one step on all ranks divided by that median. Peak memory is the maximum over ranks. The exposed and
total communication fractions of a ``--profile`` run (each rank's own device timeline) are averaged
over ranks.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

GIB = float(2**30)

REFERENCE_H200: dict[int, dict[str, tuple[float, Optional[float]]]] = {
    1: {
        "single": (52.3e3, 39.5),
        "fsdp": (47.0e3, 37.3),
        "deepspeed_stage_2": (38.2e3, 33.9),
        "deepspeed_stage_3": (26.7e3, 36.7),
    },
    2: {
        "ddp": (93.2e3, 49.3),
        "fsdp": (91.1e3, 27.5),
        "deepspeed_stage_2": (88.6e3, 26.5),
        "deepspeed_stage_3": (29.4e3, 27.1),
    },
}
"""DESIGN.md section 7: GPT-1.3B, micro-batch 8 per GPU, H200 (tokens/s, peak GiB per GPU). Shown
beside our own peer runs to spot a mis-configured peer; claims use only same-run ratios."""


@dataclass(frozen=True)
class Target:
    """One performance target of issues 2 and 3, as a same-run ratio."""

    gpus: int
    config: str
    metric: str
    """'tokens' (config >= factor x reference) or 'memory' (config <= factor x reference)."""
    reference: str
    factor: float
    issue: Union[int, str]
    """The issue's number (rendered '#N'), or a short label of where the target comes from."""


TARGETS: tuple[Target, ...] = (
    Target(1, "zero2", "tokens", "single", 1.0, 2),
    Target(1, "zero2", "tokens", "deepspeed_stage_2", 1.3, 2),
    Target(1, "zero2", "memory", "single", 1.0, 2),
    Target(1, "zero2", "memory", "deepspeed_stage_2", 1.0, 2),
    Target(1, "zero3", "tokens", "fsdp", 1.0, 3),
    Target(1, "zero3", "memory", "fsdp", 1.0, 3),
    Target(2, "zero1", "tokens", "ddp", 1.0, 2),
    Target(2, "zero2", "tokens", "ddp", 1.0, 2),
    Target(2, "zero1", "memory", "deepspeed_stage_2", 1.0, 2),
    Target(2, "zero2", "memory", "deepspeed_stage_2", 1.0, 2),
    Target(2, "zero3", "tokens", "fsdp", 1.0, 3),
    Target(2, "zero3", "tokens", "ddp", 0.97, 3),
    Target(2, "zero3", "memory", "fsdp", 1.0, 3),
)


@dataclass
class Row:
    """One configuration's line in the table."""

    config: str
    gpus: int
    status: str
    """'ok', 'failed' or 'skipped'."""
    tokens_per_s: Optional[float] = None
    step_ms: Optional[float] = None
    inner_step_ms: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    final_loss: Optional[float] = None
    profiled: bool = False
    """Whether the ranks recorded a communication profile (``peers.py --profile``)."""
    exposed_comm: Optional[float] = None
    """Fraction of the profiled wall time in which only communication kernels ran (mean over ranks)."""
    comm_total: Optional[float] = None
    """Fraction of the profiled wall time in which any communication kernel ran (mean over ranks)."""
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- reading


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of a results file (a torn last line, from a killed run, is skipped)."""
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def meta_record(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run's description, written by the parent before the first configuration."""
    return next((r for r in records if r.get("kind") == "meta"), {})


def _attempt_records(records: list[dict[str, Any]], config: str) -> list[dict[str, Any]]:
    """Records of the configuration's last attempt (a retry without fused AdamW supersedes the first)."""
    mine = [r for r in records if r.get("config") == config and r.get("kind") != "meta"]
    last = max((r.get("attempt", 0) for r in mine), default=0)
    return [r for r in mine if r.get("attempt", 0) == last]


# ---------------------------------------------------------------------------------------------------- rows


def _mean(values: list[Optional[float]]) -> Optional[float]:
    """Mean of the values that are not None (None if all are)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _ok_row(config: str, gpus: int, ranks: list[dict[str, Any]]) -> Row:
    """See [Note: aggregating ranks]."""
    n_steps = min(len(r["step_times_s"]) for r in ranks)
    step = statistics.median(max(r["step_times_s"][i] for r in ranks) for i in range(n_steps))
    inner_n = min(len(r.get("inner_times_s") or []) for r in ranks)
    inner = (
        statistics.median(max(r["inner_times_s"][i] for r in ranks) for i in range(inner_n)) if inner_n else None
    )
    tokens = sum(r["tokens_per_step_local"] for r in ranks) / step
    world = len(ranks)
    first = ranks[0]
    tflops = first["flops_per_token"] * tokens / world / 1e12
    peak = first.get("peak_flops")
    losses = [r["final_loss"] for r in ranks if r.get("final_loss") is not None]
    row = Row(
        config, gpus, "ok",
        tokens_per_s=tokens,
        step_ms=step * 1e3,
        inner_step_ms=inner * 1e3 if inner is not None else None,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / peak if peak else None,
        peak_mem_gib=max(r["peak_mem_bytes"] for r in ranks) / GIB,
        final_loss=losses[0] if losses else None,
    )
    if any("exposed_comm" in r for r in ranks):
        row.profiled = True
        row.exposed_comm = _mean([r.get("exposed_comm") for r in ranks])
        row.comm_total = _mean([r.get("comm_total") for r in ranks])
        profile_notes = {str((r.get("comm_profile") or {}).get("note")) for r in ranks} - {"None"}
        if profile_notes:
            row.notes.append("profile: " + "; ".join(sorted(profile_notes)))
    if not first.get("fused", True):
        row.notes.append("AdamW without fused=True")
    if any(loss != loss or loss in (float("inf"), float("-inf")) for loss in losses):
        row.notes.append("non-finite loss")
    return row


def build_row(records: list[dict[str, Any]], config: str, gpus: int) -> Row:
    """A configuration's row from its last attempt's records (see the module docstring)."""
    mine = _attempt_records(records, config)
    ranks = sorted((r for r in mine if r.get("kind") == "rank"), key=lambda r: r["rank"])
    errors = [r for r in mine if r.get("kind") == "error"]
    notes = [n for r in mine if r.get("kind") == "note" for n in [r["note"]]]
    if ranks and len(ranks) == ranks[0]["world_size"] and not any(e["status"] == "failed" for e in errors):
        row = _ok_row(config, gpus, ranks)
    elif errors:
        worst = next((e for e in errors if e["status"] == "failed"), errors[0])
        row = Row(config, gpus, worst["status"], notes=[worst["reason"]])
    elif ranks:
        row = Row(config, gpus, "failed", notes=[f"only {len(ranks)} of {ranks[0]['world_size']} ranks reported"])
    else:
        row = Row(config, gpus, "failed", notes=["no result recorded"])
    row.notes.extend(notes)
    return row


# ---------------------------------------------------------------------------------------------------- rendering


def _fmt_tokens(x: Optional[float]) -> str:
    if x is None:
        return "–"
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:,.0f}"


def _fmt_count(x: float) -> str:
    """1.31e9 -> '1.31 G', 2.1e5 -> '210 k' (parameters, FLOP/token)."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {suffix}"
    return f"{x:.0f} "


def _fmt(x: Optional[float], spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _fmt_comm(r: Row) -> str:
    """'3.2% / 41.0%' (exposed / total communication), 'n/a' without CUDA kernels, '–' if not profiled."""
    if not r.profiled:
        return "–"
    if r.exposed_comm is None or r.comm_total is None:
        return "n/a"
    return f"{r.exposed_comm * 100:.1f}% / {r.comm_total * 100:.1f}%"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[Row], meta: dict[str, Any]) -> str:
    """The markdown table: one row per configuration, ratio against the baseline's tokens/s."""
    gpus = int(meta.get("gpus", 1))
    base_name = meta.get("baseline", "single")
    base = next((r for r in rows if r.config == base_name and r.status == "ok"), None)
    cuda = meta.get("device_type", "cuda") == "cuda"
    refs = REFERENCE_H200.get(gpus, {}) if meta.get("reference_comparable") else {}
    mem_head = "peak mem/GPU (GiB)" if cuda else "peak RSS/proc (GiB)"
    head = ["config", "GPUs" if cuda else "procs", "tokens/s", f"× {base_name}", "TFLOP/s/GPU", "MFU", mem_head, "step (ms)", "loss"]
    profiled = any(r.profiled for r in rows)
    if profiled:
        head.append("comm (exposed / total)")
    if refs:
        head.append("DESIGN §7 (H200)")
    head.append("note")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        ratio = r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s and r.tokens_per_s else None
        cells = [
            f"`{r.config}`" if r.status == "ok" else f"`{r.config}` ({r.status})",
            str(r.gpus),
            _fmt_tokens(r.tokens_per_s),
            _fmt(ratio, ".2f"),
            _fmt(r.tflops_per_gpu, ".0f" if cuda else ".3f"),
            _fmt(r.mfu * 100 if r.mfu is not None else None, ".0f") + ("%" if r.mfu is not None else ""),
            _fmt(r.peak_mem_gib, ".1f" if cuda else ".2f"),
            _fmt(r.step_ms, ".1f"),
            _fmt(r.final_loss, ".3f"),
        ]
        if profiled:
            cells.append(_fmt_comm(r))
        if refs:
            ref = refs.get(r.config)
            cells.append(f"{_fmt_tokens(ref[0])}, {ref[1]:.1f} GiB" if ref and ref[1] else _fmt_tokens(ref[0]) if ref else "")
        cells.append(_escape("; ".join(r.notes)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_targets(
    rows: list[Row], gpus: int, targets: Sequence[Target] = TARGETS
) -> list[tuple[Target, str, str]]:
    """(target, measured, verdict) for the issues' targets at this GPU count (N > 2 without targets of its
    own uses the 2-GPU ones)."""
    by_name = {r.config: r for r in rows}
    out: list[tuple[Target, str, str]] = []
    count = gpus if any(t.gpus == gpus for t in targets) else min(gpus, 2)
    for t in targets:
        if t.gpus != count or t.config not in by_name or t.reference not in by_name:
            continue
        a, b = by_name[t.config], by_name[t.reference]
        if a.status != "ok" or b.status != "ok":
            missing = t.config if a.status != "ok" else t.reference
            out.append((t, "–", f"n/a ({missing} {by_name[missing].status})"))
            continue
        if t.metric == "tokens":
            assert a.tokens_per_s and b.tokens_per_s
            ratio = a.tokens_per_s / b.tokens_per_s
            out.append((t, f"{ratio:.2f}×", "PASS" if ratio >= t.factor else "FAIL"))
        else:
            assert a.peak_mem_gib is not None and b.peak_mem_gib is not None
            ratio = a.peak_mem_gib / b.peak_mem_gib
            measured = f"{a.peak_mem_gib:.1f} vs {b.peak_mem_gib:.1f} GiB ({ratio:.2f}×)"
            out.append((t, measured, "PASS" if ratio <= t.factor else "FAIL"))
    return out


def render_gpt_section(records: list[dict[str, Any]], configs: Optional[list[str]], title: str, workload_tail: str,
                       extra: Callable[[list[dict[str, Any]], list[Row]], str], targets: Sequence[Target]) -> str:
    """The RESULTS.md section of a GPT benchmark run through peers.py's harness (compile.py,
    fabric.py): heading, workload, versions, command, the common table, ``extra(records, rows)``
    (the benchmark's own table) and the targets. ``workload_tail`` ends the workload line (what was
    compiled, how the peers were wrapped)."""
    m = meta_record(records)
    gpus = int(m.get("gpus", 1))
    names = configs or m.get("configs") or sorted({r["config"] for r in records if "config" in r})
    rows = [build_row(records, name, gpus) for name in names]
    ranks = [r for r in records if r.get("kind") == "rank"]
    device = next((r["device_name"] for r in ranks), m.get("device_name") or "unknown device")
    dims = m.get("model", {}).get("dims", {})
    lines = [
        f"## {m.get('date', '?')} · {title} · {gpus} GPU(s) · {device}",
        "",
        f"Workload: {m.get('model', {}).get('name', '?')} ({dims.get('n_layer')} layers × d_model {dims.get('d_model')}, "
        f"seq {dims.get('seq_len')}), micro-batch {m.get('micro_batch')} per GPU, `bf16-mixed`, torch AdamW(fused=True); "
        f"{m.get('warmup')} warm-up + {m.get('steps')} timed steps; {workload_tail}",
        "",
        f"Versions: {_versions_line(m, next((r.get('versions') for r in ranks), None))}",
        "",
        f"Command: `{m.get('command', '?')}`",
        "",
        render_table(rows, m),
        "",
        extra(records, rows),
    ]
    rendered = render_targets(rows, gpus, targets)
    if rendered:
        lines += ["", rendered]
    return "\n".join(lines) + "\n"


def render_targets(rows: list[Row], gpus: int, targets: Sequence[Target] = TARGETS) -> str:
    checks = check_targets(rows, gpus, targets)
    if not checks:
        return ""
    lines = ["| target (issue) | measured | verdict |", "|---|---|---|"]
    for t, measured, verdict in checks:
        rel = "≥" if t.metric == "tokens" else "≤"
        what = "tokens/s" if t.metric == "tokens" else "peak memory"
        issue = f"#{t.issue}" if isinstance(t.issue, int) else t.issue
        lines.append(f"| `{t.config}` {what} {rel} {t.factor:.2f} × `{t.reference}` ({issue}) | {measured} | {verdict} |")
    return "\n".join(lines)


def _versions_line(meta: dict[str, Any], rows_versions: Optional[dict[str, Any]]) -> str:
    v = dict(meta.get("versions", {}))
    v.update({k: val for k, val in (rows_versions or {}).items() if val})
    parts = [f"torch {v.get('torch', '?')}" + (f" (CUDA {v['cuda']})" if v.get("cuda") else "")]
    for key in ("lightning", "deepspeed", "lightning_zero", "python"):
        parts.append(f"{key} {v.get(key) or 'not installed'}")
    return " · ".join(parts)


def render_section(records: list[dict[str, Any]], configs: Optional[list[str]] = None) -> str:
    """A dated RESULTS.md section: what ran where, the table, and the target checks."""
    meta = meta_record(records)
    gpus = int(meta.get("gpus", 1))
    names = configs or meta.get("configs") or sorted({r["config"] for r in records if "config" in r})
    rows = [build_row(records, name, gpus) for name in names]
    ranks = [r for r in records if r.get("kind") == "rank"]
    device = next((r["device_name"] for r in ranks), meta.get("device_name") or "unknown device")
    model = meta.get("model", {})
    dims = model.get("dims", {})
    n_params = next((r["n_params"] for r in ranks), None)
    fpt = next((r["flops_per_token"] for r in ranks), None)
    shape = (
        f"{dims.get('n_layer')} layers × d_model {dims.get('d_model')}, {dims.get('n_head')} heads, "
        f"seq {dims.get('seq_len')}, vocab {dims.get('vocab_size')}"
    )
    size = f"; {_fmt_count(n_params)} parameters, {_fmt_count(fpt)}FLOP/token" if n_params and fpt else ""
    unit = "GPU" if meta.get("device_type", "cuda") == "cuda" else "CPU process"
    units = f"{unit}{'es' if unit.endswith('s') else 's'}" if gpus > 1 else unit
    lines = [
        f"## {meta.get('date', '?')} · peers · {gpus} {units} · {device}",
        "",
        f"Workload: {model.get('name', '?')} ({shape}{size}), micro-batch {meta.get('micro_batch')} per "
        f"{unit}, `{meta.get('precision', 'bf16-mixed')}`, torch AdamW(fused=True); {meta.get('warmup')} warm-up + "
        f"{meta.get('steps')} timed steps, median step time (slowest rank per step), global tokens/s; "
        "TFLOP/s from `flops_per_token` (6N + attention); "
        + ("peak memory = `torch.cuda.max_memory_allocated`" if unit == "GPU" else "peak memory = peak RSS")
        + ", max over ranks. Each configuration ran in its own process(es).",
        "",
        f"Versions: {_versions_line(meta, next((r.get('versions') for r in ranks), None))}",
        "",
        f"Command: `{meta.get('command', '?')}`",
        "",
        render_table(rows, meta),
    ]
    if any(r.profiled for r in rows):
        n_prof = next((r["comm_profile"]["steps"] for r in ranks if (r.get("comm_profile") or {}).get("steps")), 3)
        lines[-1:-1] = [
            f"Comm (exposed / total): after the timed steps, {n_prof} more were profiled (`torch.profiler`, every rank); "
            "over their wall time, the fraction in which NCCL kernels ran with no other kernel on the device "
            "(exposed) and in which any NCCL kernel ran (total; total - exposed was hidden behind compute); "
            "mean over ranks (`benchmarks/overlap.py`). n/a: no CUDA kernels (CPU run).",
            "",
        ]
    if meta.get("device_type", "cuda") == "cuda":
        targets = render_targets(rows, gpus)
        if targets:
            lines += ["", targets]
    return "\n".join(lines) + "\n"


RESULTS_TITLE = """# Benchmark results

Every section below was appended by a benchmark script (`benchmarks/peers.py --write-results`, ...)
in one run on one machine. Compare rows within a section only: figures vary from run to run and
machine to machine, so every claim is a ratio measured side by side, with the device named.
"""


def append_section(results_md: Path, section: str) -> None:
    """Append a section to RESULTS.md, creating the file with its title first."""
    if not results_md.is_file() or not results_md.read_text().strip():
        results_md.write_text(RESULTS_TITLE)
    with results_md.open("a") as fh:
        fh.write("\n" + section)


__all__ = [
    "Row", "Target", "TARGETS", "REFERENCE_H200", "read_records", "meta_record", "build_row",
    "render_table", "check_targets", "render_targets", "render_section", "append_section",
]
