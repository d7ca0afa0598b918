"""What ``python -m lightning_zero.ops report|build`` prints: the toolchain and one row per op."""

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


def render_table(rows: list[OpStatus]) -> str:
    """A markdown table: op, compatible, built, where from, why not."""
    lines = ["| op | compatible | built | from | why not / notes |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        yes = {True: "yes", False: "no"}
        lines.append(f"| {row.name} | {yes[row.compatible]} | {yes[row.built]} | {row.origin} | {row.reason or '-'} |")
    return "\n".join(lines)


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
            results.append((op.name, f"ok ({op.cache.origin})"))
        except OpUnavailableError as exc:
            results.append((op.name, f"FAILED: {exc}"))
    return results


