"""One ``torchrun`` of tests/profiler/dist_worker.py per test session, shared by the profiler, PLD and
activation-offload tests (each launch costs ~10 s of process start-up on 2 cores)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.helpers.launch import ROOT, free_port

RUNS = ("prof_zero3", "prof_pipe", "pld_zero3", "pld_ddp", "act_zero3", "noact_zero3")


@functools.lru_cache(maxsize=1)
def dist_results() -> dict[str, list[dict]]:
    """run name -> [rank 0's record, rank 1's record]."""
    out = Path(tempfile.mkdtemp(prefix="issue19_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED"):
        env.pop(leaked, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(ROOT / "tests/profiler/dist_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)] for name in RUNS}
