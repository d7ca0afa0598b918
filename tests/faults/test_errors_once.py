"""Errors read once (issue #14): the same error raised on every rank (a bad learning rate: AdamW(lr=-1)
raises ``ValueError: Invalid learning rate: -1.0`` in ``configure_optimizers`` on both ranks) must be
reported in full once, the other rank saying in one line that it stopped too; and every process exits
non-zero within 60 s. (Issue: today every rank prints the full traceback, 73-87 lines each.)

The rank-1-only counterpart is ``test_error_read_once`` in test_rank_failure.py.
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import BAD_LR_CASES
from tests.faults.launch import LIMIT_S, all_full_reports, full_reports_with, summary

MESSAGE = "Invalid learning rate: -1.0"


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_LR_CASES)
def test_bad_lr_exits_nonzero_within_60s(cases, case: str) -> None:
    run = cases(case)
    assert run.fault is not None, summary(run)
    assert not run.timed_out and not run.left_alive, summary(run)
    assert run.after_fault is not None and run.after_fault <= LIMIT_S, summary(run)
    assert run.returncode not in (0, None), summary(run)
    codes = run.exit_codes()
    assert set(codes) == {0, 1} and all(c != 0 and c != "running" for c in codes.values()), summary(run)
    assert MESSAGE in run.log, summary(run)


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_LR_CASES)
def test_bad_lr_reported_once(cases, case: str) -> None:
    run = cases(case)
    with_msg = full_reports_with(run, MESSAGE)
    every = all_full_reports(run)
    lines = {src: len(run.lines(r)) for src, r in (("r0", 0), ("r1", 1))}
    info = (f"full tracebacks with {MESSAGE!r} per source: {with_msg}; all full tracebacks: {every}; "
            f"output lines per rank: {lines}\n" + summary(run))
    # Failed before issue #14's fix (every rank printed its full traceback, 2 in all); passes since
    # 4c92e64 (the first failing rank reports in full, the others one line)
    assert sum(with_msg.values()) == 1, info
    silent = [src for src in ("r0", "r1") if with_msg[src] == 0]
    assert len(silent) == 1, info
    # the other rank: one line, no traceback of its own
    assert every[silent[0]] == 0, info
    assert any(MESSAGE in ln or "stopped" in ln or "failed" in ln for ln in run.lines(int(silent[0][1]))), info
