"""Disk full during NVMe swap (issue #14): rank 1's swap I/O threads get ``OSError(ENOSPC)`` once 16 KiB
more were written from global step 2 on (``os.pwritev`` wrapped in the worker, the call nvme.py's
``seg_write`` makes). The run must end with a clear error naming the swap path, every process non-zero
within 60 s, and no swap file left.
"""

from __future__ import annotations

import re

import pytest

from tests.faults.conftest import ENOSPC_CASES
from tests.faults.launch import LIMIT_S, summary


@pytest.mark.slow
@pytest.mark.parametrize("case", ENOSPC_CASES)
def test_disk_full_ends_the_run_promptly(cases, case: str) -> None:
    run = cases(case)
    assert run.fault is not None and run.fault["rank"] == 1, "ENOSPC never injected\n" + summary(run)
    assert not run.timed_out and not run.left_alive, "hang\n" + summary(run)
    assert run.after_fault is not None and run.after_fault <= LIMIT_S, summary(run)
    assert run.returncode not in (0, None), summary(run)
    codes = run.exit_codes()
    assert all(c != 0 and c != "running" for c in codes.values()), summary(run)


@pytest.mark.slow
@pytest.mark.parametrize("case", ENOSPC_CASES)
def test_disk_full_error_names_the_swap_path(cases, case: str) -> None:
    run = cases(case)
    nvme = str(run.out / "nvme")
    named = [ln for ln in run.lines(1) if nvme in ln and re.search(r"No space left|ENOSPC|Errno 28", ln)]
    assert named, f"no error line of rank 1 names the swap path under {nvme} and says the disk is full\n" + summary(run)


@pytest.mark.slow
@pytest.mark.parametrize("case", ENOSPC_CASES)
def test_disk_full_leaves_no_swap_files(cases, case: str) -> None:
    run = cases(case)
    assert not run.swap_files, f"swap files left: {run.swap_files}\n" + summary(run)
    leaked = {r: rep["nondaemon_threads"] for r, rep in run.reports["run"].items() if rep["nondaemon_threads"]}
    assert not leaked, summary(run)
