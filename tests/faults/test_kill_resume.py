"""SIGKILL of one rank mid-step, then a re-launch (issue #14): rank 1 kills itself in
``on_before_optimizer_step`` of global step 5 (after backward, before the step) under torchrun, with a
ModelCheckpoint every 2 steps and ``save_last=True`` (lightning_zero's default sharded format). The job
must end promptly; a re-launch with ``ckpt_path="last"`` resumes at step 4 and its per-step losses equal
an uninterrupted run's to 1e-6 (fp32). Every global step trains on a fixed batch (CkptNet,
tests/checkpoint/models.py). With NVMe offload, the killed run's swap files are gone after the re-launch
(its owner is dead: the next run removes them).
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import KILL_AT, KILL_CASES, KILL_EVERY, KILL_STEPS
from tests.faults.launch import LIMIT_S, summary

TOL = 1e-6
RESUME_AT = (KILL_AT // KILL_EVERY) * KILL_EVERY  # 4: the last complete checkpoint before the kill


@pytest.mark.slow
@pytest.mark.parametrize("case", KILL_CASES)
def test_killed_job_ends_promptly(cases, case: str) -> None:
    kr = cases(case)
    run = kr.killed
    assert run.fault is not None and run.fault["what"] == "sigkill", "rank 1 never killed itself\n" + summary(run)
    assert not run.timed_out and not run.left_alive, summary(run)
    assert run.after_fault is not None and run.after_fault <= LIMIT_S, summary(run)
    assert run.returncode not in (0, None), summary(run)
    assert f"epoch=0-step={RESUME_AT}.ckpt" in kr.listing_after_kill and "last.ckpt" in kr.listing_after_kill, \
        kr.listing_after_kill


@pytest.mark.slow
@pytest.mark.parametrize("case", KILL_CASES)
def test_relaunch_resumes_with_the_same_losses(cases, case: str) -> None:
    kr = cases(case)
    run = kr.resumed
    info = summary(run)
    assert run.returncode == 0 and not run.timed_out, info
    for name in ("resume", "ref"):
        assert set(run.reports[name]) == {0, 1}, (name, info)
        assert all(rep["exc_type"] is None for rep in run.reports[name].values()), (name, info)
    for r in (0, 1):
        resumed = dict((int(s), v) for s, v in run.reports["resume"][r]["losses"])
        ref = dict((int(s), v) for s, v in run.reports["ref"][r]["losses"])
        assert sorted(resumed) == list(range(RESUME_AT, KILL_STEPS)), (r, sorted(resumed))
        diffs = {s: abs(resumed[s] - ref[s]) for s in resumed}
        assert max(diffs.values()) <= TOL, (r, diffs, resumed, ref)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in KILL_CASES if c.endswith("nvme")])
def test_relaunch_removes_the_killed_runs_swap_files(cases, case: str) -> None:
    kr = cases(case)
    assert kr.killed.swap_files, "the killed run left no swap files (nothing to check)"
    assert not kr.resumed.swap_files, (kr.resumed.swap_files, kr.resumed.swap_dirs)
