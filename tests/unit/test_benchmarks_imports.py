"""benchmarks/ is one importable package: no file edits ``sys.path``, and a driver runs as a script from the
repository root with the checkout on ``PYTHONPATH`` (how benchmarks/run_gpu.sh and run_multi.sh call them)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers.launch import ROOT, user_env

BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def _sys_path_uses(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``sys.path`` (an attribute ``path`` of a name ``sys``)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"]


def test_no_benchmark_edits_sys_path() -> None:
    assert len(BENCHMARKS) > 10
    offenders = {p.name: lines for p in BENCHMARKS if (lines := _sys_path_uses(p))}
    assert offenders == {}, offenders


def test_the_checker_sees_a_sys_path_edit(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path(__file__).parent))\n")
    assert _sys_path_uses(bad) == [3]


def test_shared_pieces_import_as_a_package() -> None:
    from benchmarks import overlap, peers, peers_report, presets

    assert callable(peers.child_env) and callable(peers_report.read_records)
    assert presets.PEERS and callable(overlap.comm_overlap)


def test_every_benchmark_module_imports() -> None:
    """Drivers and workers import their shared pieces (records.py, timing.py, comm_profile.py, peers_worker.py)
    by name: a piece moved or renamed breaks here, not on the GPU machine. Importing runs nothing (each file
    starts its work under ``if __name__ == "__main__"``)."""
    import importlib

    for path in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{path.stem}")
        assert module.__file__ is not None and Path(module.__file__).resolve() == path.resolve()


def test_a_driver_runs_as_a_script_from_the_root() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/peers.py", "--help"], cwd=ROOT, env=user_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--gpus" in proc.stdout
