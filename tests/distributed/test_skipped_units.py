"""Data-dependent control flow under ZeRO-3 (issue #14): a unit skipped on one rank only used to
mismatch the gather collectives and hang; gathers now catch up with the recorded order
(stage3.py [Note: units skipped on one rank]) and training matches ddp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import ROOT, free_port


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("skip")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED"):
        env.pop(leaked, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(ROOT / "tests/distributed/skip_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {p.stem: torch.load(p)["losses"] for p in Path(out).glob("*.pt")}


@pytest.mark.parametrize("skip", [0, 2, 3])
def test_a_unit_skipped_on_one_rank_trains_like_ddp(runs: dict[str, list[float]], skip: int) -> None:
    ref, got = runs[f"skip{skip}_ddp"], runs[f"skip{skip}_zero3"]
    assert len(ref) == len(got) == 6
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-7)
