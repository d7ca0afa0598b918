"""Ranks with different amounts of work (issue #27, item 7; lightning_zero/uneven.py [Note: uneven
inputs]). Per-rank training loaders of 5 and 7 batches without a distributed sampler: before, the rank
with 5 exited 0 while the other died in step 6 in a collective with gloo's "Connection closed by peer"
(swapped: exit 1, same message). Now every rank stops at the first batch of the epoch that would part
them, non-zero, with one line naming the rank that runs out, the batch, and the fix. A fit that
``max_steps`` ends before the ranks part runs as under ddp. Stage 3 validation loops of different
lengths are refused the same way (every evaluation forward gathers parameters).
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import UNEVEN_CASES
from tests.faults.launch import all_full_reports, summary

MAX_LINES = 40
"""The ranks' own output lines (Lightning's banners included; torchrun's agent summary excluded)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", UNEVEN_CASES)
def test_uneven_ranks_stop_together_in_one_line_each(cases, case: str) -> None:
    run = cases(case)
    info = summary(run)
    assert not run.timed_out and not run.left_alive, "hang\n" + info
    codes = run.exit_codes()
    assert set(codes) == {0, 1} and all(c not in (0, "running", None) for c in codes.values()), info
    name = "val" if "val" in case else "uneven"
    assert {r: rep["exc_type"] for r, rep in run.reports[name].items()} == {0: "UnevenInputsError",
                                                                           1: "UnevenInputsError"}, info
    reports = all_full_reports(run)
    assert reports["r0"] == reports["r1"] == 0, info  # no traceback from a rank (torchrun's own summary aside)
    lines = {r: [ln for ln in run.lines(r) if "UnevenInputsError" in ln] for r in (0, 1)}
    assert all(len(v) == 1 for v in lines.values()), lines
    text = " ".join(lines[0] + lines[1])
    assert "use_distributed_sampler" in text and "drop_last" in text, text
    if "val" in case:
        assert "validation loop" in text and "rank 0: 2, rank 1: 3" in text, text
    else:
        short = 0 if "57" in case else 1
        assert f"rank {short} runs out of training batches at batch 5 of epoch 0" in text, text
        assert all(not rep["losses"] for rep in run.reports[name].values()), info  # stopped before any step
    assert len(run.lines(0)) + len(run.lines(1)) <= MAX_LINES, info


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in UNEVEN_CASES if "57" in c])
def test_uneven_loaders_that_max_steps_stops_first_train_as_under_ddp(cases, case: str) -> None:
    run = cases(case)
    reps = run.reports["ok"]
    assert set(reps) == {0, 1} and all(rep["exc_type"] is None for rep in reps.values()), summary(run)
    assert all([s for s, _ in rep["losses"]] == [0, 1, 2, 3, 4] for rep in reps.values()), summary(run)
