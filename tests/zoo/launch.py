"""Run tests/zoo/zoo_worker.py under torchrun (2 gloo ranks on CPU) and load what it wrote.

Unlike tests/helpers/launch.py a failing or hanging worker does not raise here: every run that
finished is loaded, and each missing one is reported by the test that needs it, with the worker's
output, so one broken configuration does not hide the results of the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tests.helpers.launch import ROOT, free_port

WORKER = ROOT / "tests/zoo/zoo_worker.py"


@dataclass
class ZooRuns:
    """One model's runs: spec -> result dict (see zoo_worker.py), plus how the worker ended."""

    model: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    returncode: Optional[int] = None
    timed_out: bool = False
    log: str = ""
    seconds: float = 0.0

    def get(self, spec: str) -> dict[str, Any]:
        """The run ``spec``; fails the calling test with the worker's output when it has none."""
        if spec not in self.results:
            how = "timed out" if self.timed_out else f"exited with {self.returncode}"
            raise AssertionError(f"{self.model}/{spec}: no result (worker {how}). Worker output:\n{self.log[-6000:]}")
        return self.results[spec]


def run_zoo(tmp: Path, model: str, specs: list[str], nproc: int = 2, timeout: int = 420) -> ZooRuns:
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PL_GLOBAL_SEED"):
        env.pop(leaked, None)  # left behind by in-process Lightning runs of other tests
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        str(WORKER), str(tmp), model, *specs,
    ]
    runs = ZooRuns(model)
    started = time.perf_counter()
    # A session of its own: on a timeout the whole tree (torchrun and its workers) is killed.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        runs.timed_out = True
    runs.returncode = proc.returncode
    runs.log = out or ""
    runs.seconds = time.perf_counter() - started
    for spec in specs:
        path = tmp / f"{model}_{spec}.pt"
        if path.exists():
            runs.results[spec] = torch.load(path, weights_only=False)
    return runs
