"""What ``python -m lightning_zero.ops report|build`` prints: the toolchain, one row per op (does it
run here, can it be built here), and which ops this machine will run compiled."""

from __future__ import annotations

from lightning_zero.ops import builder, cuda_arch
from lightning_zero.ops.builder import OpBuilder, OpStatus, OpUnavailableError


def environment_lines() -> list[str]:
    """The facts that decide compatibility, one per line."""
    import torch

    toolkit, why = cuda_arch.find_cuda_toolkit()
    cxx, cxx_why = builder.find_cxx()
    try:
        spec, source = cuda_arch.resolve_arch_list()
        arch = f"{spec} (from {source}) -> {' '.join(cuda_arch.gencode_flags(spec))}"
    except ValueError as exc:
        arch = f"invalid: {exc}"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), GPU: {gpu}",
        f"C++ compiler: {cxx or cxx_why}",
        f"nvcc: {f'{toolkit.nvcc} (CUDA {toolkit.version}, home {toolkit.home})' if toolkit else why}",
        f"CUDA arch list: {arch}",
        f"sources: {builder.csrc_root() or 'not found'}",
        f"build root: {builder.build_root()}",
        f"JIT: {'disabled by ' + builder.ENV_DISABLE_JIT if builder.jit_disabled() else 'enabled'}",
    ]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _notes(row: OpStatus) -> str:
    if row.runs:
        return row.reason or "-"
    why = row.runs_reason or row.reason
    if not row.device_present:
        return f"{why}: not used on this machine"
    return f"{why}; falls back to {row.fallback}" if row.fallback else why


def render_table(rows: list[OpStatus]) -> str:
    """A markdown table: op, device, runs here, builds here, built, where from, notes.

    "runs here" is what a user needs (does this machine use the compiled op?); "builds here" is the
    compile check (a CUDA op builds on a CPU-only machine with nvcc, but does not run there). Where the
    op does not run, the notes say why, and what replaces it where its device exists.
    """
    lines = [
        "| op | device | runs here | builds here | built | from | why not / notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.device} | {_yes(row.runs)} | {_yes(row.compatible)} | {_yes(row.built)} "
            f"| {row.origin} | {_notes(row)} |"
        )
    return "\n".join(lines)


def summary_lines(rows: list[OpStatus]) -> list[str]:
    """What this machine will actually run: the compiled ops, the fallbacks, the ops it has no use for."""
    runs = [row.name for row in rows if row.runs]
    falls = [row.name for row in rows if not row.runs and row.device_present]
    unused = [row for row in rows if not row.runs and not row.device_present]
    lines = [f"Runs compiled on this machine: {', '.join(runs) if runs else 'none'}."]
    if falls:
        lines.append(f"Runs a slower fallback instead (see notes): {', '.join(falls)}.")
    if unused:
        devices = " or ".join(sorted({row.device.upper() for row in unused}))
        lines.append(f"Not used here (no {devices} device): {', '.join(row.name for row in unused)}.")
    return lines


def build_all(ops: list[OpBuilder], verbose: bool = False) -> list[tuple[str, str]]:
    """Build every compatible op; (name, 'ok ...' | 'skipped: ...' | 'FAILED: ...') per op."""
    results = []
    for op in ops:
        ok, why = op.is_compatible()
        if not ok:
            results.append((op.name, f"skipped: {why}"))
            continue
        try:
            op.load(verbose=verbose)
            runs, why = op.runtime_check()
            results.append((op.name, f"ok ({op.cache.origin})" + ("" if runs else f"; does not run here: {why}")))
        except OpUnavailableError as exc:
            results.append((op.name, f"FAILED: {exc}"))
    return results


