"""Launch tests/helpers/dist_worker.py under torchrun on CPU/gloo and load its results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

ACCELERATOR_ENV = "LZ_TEST_ACCELERATOR"
"""``gpu`` runs the multi-process parity workers on CUDA with NCCL, one GPU per rank (issue #32: the tensor-
parallel, MoE and pipeline parity suites over NCCL, tests/distributed/test_nccl.py); unset or ``cpu``: gloo."""


def worker_accelerator() -> str:
    """The Trainer's ``accelerator`` for the parity workers: ``cpu`` unless ``LZ_TEST_ACCELERATOR=gpu``."""
    return "gpu" if os.environ.get(ACCELERATOR_ENV, "cpu") == "gpu" else "cpu"


def skip_without_gpus(nproc: int) -> None:
    """Skip the calling fixture when its workers run on GPUs (``LZ_TEST_ACCELERATOR=gpu``) and there are
    fewer than ``nproc``: NCCL refuses two ranks on one GPU. On CPU (gloo) nothing is skipped."""
    if worker_accelerator() == "gpu" and torch.cuda.device_count() < nproc:
        import pytest

        pytest.skip(f"{nproc} ranks over NCCL need {nproc} GPUs; {torch.cuda.device_count()} here")


def worker_env() -> dict[str, str]:
    """The environment of a launched worker: one thread per rank, no warnings, GPUs hidden unless asked for."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if worker_accelerator() == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHER_ENV = {"LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
"""What a Lightning run earlier in this pytest process leaves in os.environ: with LOCAL_RANK set, a launched
script's Lightning waits for a rank 1 it believes someone else starts (a hang until the 1800 s timeout)."""


def user_env(**extra: str) -> dict[str, str]:
    """os.environ as a user's shell has it (no launcher variables, no ``PL_*``), with ``PYTHONPATH`` on the
    repository, plus ``extra``: for scripts the tests start as a user would (examples/train.py)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("PL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _clean_env() -> dict[str, str]:
    env = worker_env()
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED",
                   "LOCAL_WORLD_SIZE"):
        env.pop(leaked, None)  # left behind by in-process Lightning runs of other tests
    return env


def run_worker(tmp: Path, nproc: int, runs: dict[str, str], timeout: int = 600,
               script: str = "tests/helpers/dist_worker.py") -> dict[str, dict]:
    """Run ``script OUT NAME=SPEC...`` under torchrun; each run's ``OUT/NAME.pt`` (written by rank 0)."""
    skip_without_gpus(nproc)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        str(ROOT / script), str(tmp),
    ] + [f"{k}={v}" for k, v in runs.items()]
    proc = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return {k: torch.load(tmp / f"{k}.pt", weights_only=False) for k in runs}


def run_worker_nodes(tmp: Path, nodes: int, nproc: int, runs: dict[str, str], timeout: int = 600,
                     script: str = "tests/helpers/dist_worker.py") -> dict[str, dict]:
    """``run_worker`` as ``nodes`` simulated nodes on this machine: one torchrun per node, each with
    ``--nnodes``, its ``--node-rank`` and a common static rendezvous (what a multi-node job's launch
    looks like), so anything that reads ranks per node sees the launcher's values."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
             f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
             str(ROOT / script), str(tmp)] + [f"{k}={v}" for k, v in runs.items()],
            cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(nodes)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError(f"node(s) failed {failed}:\n" + "\n".join(o[-4000:] for o in outputs))
    return {k: torch.load(tmp / f"{k}.pt", weights_only=False) for k in runs}
