"""Errors under ``examples/train.py`` (issue #27, item 6), the script run as a user runs it (2 CPU ranks,
Lightning's launcher). Before: every rank printed the full traceback (Hydra prints an escaping error
itself, before the one-line excepthook of failures.py could), and a bad ``nvme_path`` was found only
after the launch and the model's build. Now the path is checked when the config is built (no process
group exists yet), the ``zero3_offload_nvme`` preset has no default path, and an error raised on every
rank during fit is printed in full by one rank and in one line by the other (failures.reported_once).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoint.launch import clean_env
from tests.faults.launch import traceback_reports
from tests.helpers.launch import ROOT
from tests.helpers.side_by_side import SideBySide

BOUND_S = 180
MAX_LINES = 40
NVME_CASES = {"missing": "does not exist", "no_path": "needs nvme_path"}
"""The two refused ``zero3_offload_nvme`` runs: a path that does not exist, and none at all."""


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "train.py"), "model=gpt_tiny", "trainer=debug", "logger=none",
            *overrides, f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SideBySide]:
    """The module's three CLI runs, started at once (tests/helpers/side_by_side.py [Note: side by side])."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    started = SideBySide({
        "bad_lr": _command(tmp / "bad_lr", "optimizer.lr=-1"),  # AdamW raises in configure_optimizers on both ranks
        "missing": _command(tmp / "missing", "strategy=zero3_offload_nvme", f"strategy.nvme_path={tmp / 'nope'}"),
        "no_path": _command(tmp / "no_path", "strategy=zero3_offload_nvme"),
    }, cwd=ROOT, env=clean_env(), timeout=BOUND_S)
    try:
        yield started
    finally:
        started.close()


@pytest.mark.slow
def test_bad_nvme_path_is_refused_before_any_process_starts(runs: SideBySide) -> None:
    for name, message in NVME_CASES.items():
        proc = runs.get(name)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and message in out, out[-3000:]
        assert "Initializing distributed" not in out, out[-3000:]  # refused before the launch
        assert len(out.splitlines()) <= MAX_LINES, out


@pytest.mark.slow
def test_an_error_on_every_rank_is_printed_in_full_once(runs: SideBySide) -> None:
    proc = runs.get("bad_lr")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = out.splitlines()
    reports = [r for r in traceback_reports(lines) if any("Invalid learning rate" in ln for ln in r)]
    assert len(reports) == 1, out  # one rank's traceback (Hydra's, trimmed)
    assert sum(re.search(r"\[rank [01]\] stopped: ValueError: Invalid learning rate", ln) is not None
               for ln in lines) == 1, out  # the other rank (whichever was second)
    assert len(lines) <= 70, out  # one traceback through Lightning's stack (~38 lines), banners, one line
