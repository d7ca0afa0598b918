"""Run scenario ``checkpoint.plan`` (tests/checkpoint/scenarios.py) through the distributed-test harness
(tests/helpers/harness.py) and view what each rank recorded.

Like the zoo, a failing, killed or hanging launch does not raise here: every step that finished is loaded,
and a test that needs a missing one fails with the worker's output. The harness kills the whole process tree
on a timeout (no test can hang CI).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tests.helpers.harness import ScenarioRun, run_scenario

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def clean_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED",
                   "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(leaked, None)  # left behind by in-process Lightning runs of other tests
    return env


@dataclass
class Launch:
    """One launch's steps: name -> per-rank results (see scenarios.py), plus how it ended."""

    run: ScenarioRun
    steps: list[str]

    @property
    def tmp(self) -> Path:
        return self.run.out

    @property
    def nproc(self) -> int:
        return self.run.nprocs

    @property
    def returncode(self) -> Optional[int]:
        return self.run.returncode

    @property
    def timed_out(self) -> bool:
        return self.run.timed_out

    @property
    def log(self) -> str:
        return self.run.log

    @property
    def seconds(self) -> float:
        return self.run.seconds

    @property
    def results(self) -> dict[str, list[Optional[dict[str, Any]]]]:
        return {name: self.run.ranks(name) for name in self.steps}

    def ranks(self, name: str) -> list[dict[str, Any]]:
        """Every rank's result of step ``name``; fails the calling test when a rank has none."""
        got = self.run.ranks(name) if name in self.steps else []
        if len(got) != self.nproc or any(r is None for r in got):
            have = [i for i, r in enumerate(got) if r is not None]
            raise AssertionError(f"{name}: results of ranks {have} of {self.nproc} only (worker {self.run.how()}). "
                                 f"Worker output:\n{self.log[-8000:]}")
        return got  # type: ignore[return-value]

    def ok(self, name: str) -> list[dict[str, Any]]:
        """Like :meth:`ranks`, and every rank must have finished without an exception."""
        got = self.ranks(name)
        errors = [f"rank {r['rank']}:\n{r['error']}" for r in got if r["error"]]
        if errors:
            raise AssertionError(f"{name} failed:\n" + "\n".join(errors)[-8000:])
        return got


def launch(tmp: Path, nproc: int, plan: list[dict[str, Any]], timeout: int = 300, launcher: str = "direct") -> Launch:
    run = run_scenario("checkpoint.plan", nprocs=nproc, params={"plan": plan}, timeout=timeout, out=tmp, env=CPU_ONLY,
                       launcher=launcher)
    return Launch(run, [step["name"] for step in plan])
