"""Bad configurations of the example are refused before anything starts, in one line, and leave no run
directory behind (issue #28): an added unknown key, a misspelt top-level key, an unknown nested key, a
missing checkpoint, and a refusal from inside the build (a 1-bit optimizer under a stage it cannot use)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("override", "says"), [
    ("+unknown_key=1", "unknown config key 'unknown_key'"),
    ("seeed=1", "did you mean 'seed'?"),
    ("+trainer.max_stepz=3", "unknown config key(s) trainer.max_stepz"),
    ("ckpt_path=nowhere/last.ckpt", "does not exist"),
    ("optimizer=onebit_adam", "works with ZeRO stage(s) [0] only"),
])
def test_refused_in_one_line_without_a_run_directory(tmp_path: Path, override: str, says: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), override, "logger=none"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert len([line for line in lines if says in line]) == 1
    assert len(lines) == 1, lines
    assert not any(p.is_file() or p.name == ".hydra" for p in tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))
