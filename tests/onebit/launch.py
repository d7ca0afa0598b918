"""Run a worker script of this folder under torchrun on CPU/gloo and load what rank 0 saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.launch import ROOT, free_port


def torchrun(script: str, nproc: int, out: Path, *args: str, timeout: int = 300) -> Any:
    """``torchrun --nproc-per-node nproc tests/onebit/<script> <out> <args>``; returns ``torch.load(out/result.pt)``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED"):
        env.pop(leaked, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        str(ROOT / "tests" / "onebit" / script), str(out), *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return torch.load(out / "result.pt", weights_only=False)
