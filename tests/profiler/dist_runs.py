"""One launch of scenario ``profiler.dist`` (tests/profiler/dist_checks.py) per test session, shared by the
profiler, PLD and activation-offload tests (each launch costs ~10 s of process start-up on 2 cores)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from tests.helpers.harness import run_scenario

RUNS = ("prof_zero3", "prof_pipe", "pld_zero3", "pld_ddp", "act_zero3", "noact_zero3")


@functools.lru_cache(maxsize=1)
def dist_results() -> dict[str, list[dict]]:
    """run name -> [rank 0's record, rank 1's record]."""
    out = Path(tempfile.mkdtemp(prefix="issue19_"))
    run = run_scenario("profiler.dist", nprocs=2, timeout=600, out=out, env={"CUDA_VISIBLE_DEVICES": ""}).check()
    return {name: run.ranks(name) for name in RUNS}
