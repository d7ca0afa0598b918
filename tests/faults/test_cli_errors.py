"""Errors under ``examples/train.py`` (issue #27, item 6), the script run as a user runs it (2 CPU ranks,
Lightning's launcher). Before: every rank printed the full traceback (Hydra prints an escaping error
itself, before the one-line excepthook of failures.py could), and a bad ``nvme_path`` was found only
after the launch and the model's build. Now the path is checked when the config is built (no process
group exists yet), the ``zero3_offload_nvme`` preset has no default path, and an error raised on every
rank during fit is printed in full by one rank and in one line by the other (failures.reported_once).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.launch import clean_env
from tests.faults.launch import traceback_reports
from tests.helpers.launch import ROOT

BOUND_S = 180
MAX_LINES = 40


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "model=gpt_tiny", "trainer=debug", "logger=none",
           *overrides, f"hydra.run.dir={tmp_path}"]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=BOUND_S)


@pytest.mark.slow
def test_bad_nvme_path_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    for overrides, message in [((f"strategy.nvme_path={tmp_path / 'nope'}",), "does not exist"),
                               ((), "needs nvme_path")]:
        proc = _train(tmp_path, "strategy=zero3_offload_nvme", *overrides)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and message in out, out[-3000:]
        assert "Initializing distributed" not in out, out[-3000:]  # refused before the launch
        assert len(out.splitlines()) <= MAX_LINES, out


@pytest.mark.slow
def test_an_error_on_every_rank_is_printed_in_full_once(tmp_path: Path) -> None:
    proc = _train(tmp_path, "optimizer.lr=-1")  # AdamW raises in configure_optimizers on both ranks
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = out.splitlines()
    reports = [r for r in traceback_reports(lines) if any("Invalid learning rate" in ln for ln in r)]
    assert len(reports) == 1, out  # one rank's traceback (Hydra's, trimmed)
    assert sum(re.search(r"\[rank [01]\] stopped: ValueError: Invalid learning rate", ln) is not None
               for ln in lines) == 1, out  # the other rank (whichever was second)
    assert len(lines) <= 70, out  # one traceback through Lightning's stack (~38 lines), banners, one line
