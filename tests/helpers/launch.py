"""The launch environment of the distributed tests (``worker_env``, ``user_env``, ``LZ_TEST_ACCELERATOR``) and
``run_worker``, the named-runs front of the harness (tests/helpers/harness.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]

ACCELERATOR_ENV = "LZ_TEST_ACCELERATOR"
"""``gpu`` runs the multi-process parity workers on CUDA with NCCL, one GPU per rank (issue #32: the tensor-
parallel, MoE and pipeline parity suites over NCCL, tests/distributed/test_nccl.py); unset or ``cpu``: gloo."""


def worker_accelerator() -> str:
    """The Trainer's ``accelerator`` for the parity workers: ``cpu`` unless ``LZ_TEST_ACCELERATOR=gpu``."""
    return "gpu" if os.environ.get(ACCELERATOR_ENV, "cpu") == "gpu" else "cpu"


def skip_without_gpus(nproc: int) -> None:
    """Skip the calling test or fixture when its workers run on GPUs (``LZ_TEST_ACCELERATOR=gpu``) and there
    are fewer than ``nproc``: NCCL refuses two ranks on one GPU. On CPU (gloo) nothing is skipped."""
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
    """A port for a launch's store that is free now, chosen below the kernel's ephemeral range: a port the kernel
    hands out (``bind(0)``) is also what it gives outgoing connections, and gloo's many connections took one
    between this check and torchrun's bind (EADDRINUSE, CI 2026-11-29). Random (not Python's seeded generator),
    so concurrent or consecutive launches do not walk the same ports; ``bind(0)`` when none is found."""
    import random
    import socket

    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    pick = random.SystemRandom()
    for _ in range(64):
        port = pick.randint(20000, max(20001, ephemeral_low - 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


def run_worker(tmp: Path, nproc: int, runs: dict[str, str], timeout: int = 600,
               scenario: str = "distributed.parity", nodes: int = 1,
               env: Optional[dict[str, str]] = None) -> dict[str, dict]:
    """Run the named runs ``{NAME: SPEC}`` of a multi-run scenario (tests/helpers/worker_io.py: ``run_specs``,
    ``run_against_oracle``) through the harness; each run's ``OUT/NAME.pt`` (written by rank 0). ``nodes``:
    that many simulated nodes of ``nproc`` ranks, one torchrun each with ``--nnodes``, its ``--node-rank`` and a
    common static rendezvous (what a multi-node job's launch looks like). ``env``: on top of the harness's."""
    from tests.helpers.harness import run_scenario

    run = run_scenario(scenario, nprocs=nproc, params={"runs": runs}, timeout=timeout, out=tmp, nodes=nodes,
                       env=env).check()
    missing = [k for k in runs if run.saved(k) is None]
    if missing:
        raise AssertionError(f"{scenario}: no result for {missing}:\n{run.log[-8000:]}")
    return {k: run.saved(k) for k in runs}


def run_worker_nodes(tmp: Path, nodes: int, nproc: int, runs: dict[str, str], timeout: int = 600,
                     scenario: str = "distributed.parity") -> dict[str, dict]:
    """``run_worker`` as ``nodes`` simulated nodes on this machine."""
    return run_worker(tmp, nproc, runs, timeout, scenario, nodes=nodes)
