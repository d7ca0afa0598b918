"""Run tests/checkpoint/ckpt_worker.py under torchrun (CPU, gloo) and load what each rank wrote.

Like tests/zoo/launch.py, a failing, killed or hanging worker does not raise here: every step that
finished is loaded, and a test that needs a missing one fails with the worker's output. The whole
process tree runs in a session of its own and is killed on a timeout (no test can hang CI).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tests.helpers.launch import ROOT, free_port

WORKER = ROOT / "tests/checkpoint/ckpt_worker.py"


def clean_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED",
                   "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(leaked, None)  # left behind by in-process Lightning runs of other tests
    return env


@dataclass
class Launch:
    """One torchrun's steps: name -> per-rank results (see ckpt_worker.py), plus how it ended."""

    tmp: Path
    nproc: int
    results: dict[str, list[Optional[dict[str, Any]]]] = field(default_factory=dict)
    returncode: Optional[int] = None
    timed_out: bool = False
    log: str = ""
    seconds: float = 0.0

    def _how(self) -> str:
        return "timed out" if self.timed_out else f"exited with {self.returncode}"

    def ranks(self, name: str) -> list[dict[str, Any]]:
        """Every rank's result of step ``name``; fails the calling test when a rank has none."""
        got = self.results.get(name, [])
        if len(got) != self.nproc or any(r is None for r in got):
            have = [i for i, r in enumerate(got) if r is not None]
            raise AssertionError(f"{name}: results of ranks {have} of {self.nproc} only (worker {self._how()}). "
                                 f"Worker output:\n{self.log[-8000:]}")
        return got  # type: ignore[return-value]

    def ok(self, name: str) -> list[dict[str, Any]]:
        """Like :meth:`ranks`, and every rank must have finished without an exception."""
        got = self.ranks(name)
        errors = [f"rank {r['rank']}:\n{r['error']}" for r in got if r["error"]]
        if errors:
            raise AssertionError(f"{name} failed:\n" + "\n".join(errors)[-8000:])
        return got


def launch(tmp: Path, nproc: int, plan: list[dict[str, Any]], timeout: int = 300) -> Launch:
    tmp.mkdir(parents=True, exist_ok=True)
    plan_path = tmp / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        str(WORKER), str(tmp), str(plan_path),
    ]
    run = Launch(tmp, nproc)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        run.timed_out = True
    run.returncode = proc.returncode
    run.log = out or ""
    run.seconds = time.perf_counter() - started
    for step in plan:
        per_rank: list[Optional[dict[str, Any]]] = []
        for r in range(nproc):
            path = tmp / f"{step['name']}.rank{r}.pt"
            per_rank.append(torch.load(path, weights_only=False) if path.exists() else None)
        run.results[step["name"]] = per_rank
    return run


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -m lightning_zero.checkpoint ARGS`` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "lightning_zero.checkpoint", *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)
