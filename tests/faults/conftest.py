"""Fault-injection launches (issue #14), each run once per session, the first time a test needs it.

A *case* is one launch of scenario ``faults.plan`` (fault_runs.py) on 2 gloo ranks (one fault each: every fault
needs a job of its own), named ``<strategy>-<fault>-<launcher>``; the kill-and-resume cases are two
launches in a row. The cases the selected tests need are launched together when the first of them is
asked for, ``FAULTS_JOBS`` at a time (default 2; set 1 on a busy machine).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from tests.faults.launch import FaultRun, launch

STRATEGIES = ["zero2", "zero3", "zero3_offload", "zero3_offload_nvme"]
LAUNCHERS = ["torchrun", "lightning"]
AT = 2
"""Global step of the step/callback faults (two clean steps first)."""
STEPS = 4

KILL_STRATEGIES = ["zero3", "zero3_offload_nvme"]
KILL_AT = 5
"""Rank 1 SIGKILLs itself in on_before_optimizer_step of global step 5 (checkpoints at steps 2 and 4)."""
KILL_EVERY = 2
KILL_STEPS = 8


def rank1_cases() -> list[str]:
    cases = [f"{s}-{f}-{lch}" for s in STRATEGIES for f in ("train_step", "batch_end") for lch in LAUNCHERS]
    cases += [f"zero3_offload_nvme-nvme_eio-{lch}" for lch in LAUNCHERS]
    # rank 1 raises in training_step while rank 0's swap-file removal is slow (0.5 s a file): the
    # launcher's reaction (torchrun: SIGTERM to the survivors; Lightning: SIGKILL after <= 5 s) lands in
    # the middle of rank 0's cleanup. A first run of the suite hit that by chance (ENOSPC case, torchrun).
    cases += [f"zero3_offload_nvme-slowclean-{lch}" for lch in LAUNCHERS]
    return cases


BAD_LR_CASES = [f"zero2-bad_lr-{lch}" for lch in LAUNCHERS]
UNEVEN_CASES = ["zero2-uneven57-torchrun", "zero3-uneven75-lightning", "zero3-unevenval-torchrun"]
"""Per-rank loaders of 5 and 7 batches (no distributed sampler): zero2 first runs a fit that max_steps=5 ends
before the ranks part (it must succeed, as under ddp), then one epoch (refused); zero3 the same epoch with the
ranks swapped; ``unevenval``: stage 3 validation loops of 2 and 3 batches."""
RANK0_KILL_CASES = [f"zero3-sigkill0-{lch}" for lch in LAUNCHERS]
"""Rank 0 (the rendezvous store's host under Lightning's launcher) SIGKILLs itself at global step AT."""
ENOSPC_CASES = ["zero3_offload_nvme-nvme_enospc-torchrun"]
KILL_CASES = [f"kill-{s}" for s in KILL_STRATEGIES]


@dataclass
class KillResume:
    killed: FaultRun
    resumed: FaultRun
    ckpt_dir: Path
    listing_after_kill: list[str]


def _uneven_plan(strategy: str, fault: str) -> list[dict[str, Any]]:
    if fault == "unevenval":
        return [{"name": "val", "strategy": strategy, "batches": [2, 2], "val_batches": [2, 3], "steps": -1, "epochs": 1}]
    batches = [5, 7] if fault == "uneven57" else [7, 5]
    plan = [{"name": "ok", "strategy": strategy, "batches": batches, "steps": 5}] if fault == "uneven57" else []
    return plan + [{"name": "uneven", "strategy": strategy, "batches": batches, "steps": -1, "epochs": 1}]


def _fault_case(case: str, out: Path) -> FaultRun:
    strategy, fault, launcher = case.split("-")
    if fault.startswith("uneven"):
        return launch(out, _uneven_plan(strategy, fault), launcher)
    spec: dict[str, Any] = {"name": "run", "strategy": strategy, "fault": fault, "at": AT, "steps": STEPS}
    if fault == "slowclean":
        spec.update(fault="train_step", slow_cleanup=True)
    if fault == "sigkill0":
        spec.update(fault="sigkill", kill_rank=0)
    if fault == "nvme_eio":
        spec["after"] = 2  # the 2nd read/write of rank 1's I/O threads from step 2 on
    if fault == "nvme_enospc":
        spec.update(after=16 << 10, steps=6)  # disk full once 16 KiB more were written from step 2 on
    return launch(out, [spec], launcher)


def _kill_case(case: str, out: Path) -> KillResume:
    strategy = case.split("-", 1)[1]
    ckpt = out / "ckpts"
    ck = {"dirpath": str(ckpt), "every": KILL_EVERY}
    killed = launch(out / "killed", [{"name": "kill", "strategy": strategy, "fault": "sigkill", "at": KILL_AT,
                                      "steps": KILL_STEPS, "ckpt": ck}], "torchrun")
    listing = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
    # the re-launch: the same job resumed from "last", then an uninterrupted run of the same job (its
    # own checkpoints, so that it saves exactly when the others did) as the reference
    plan = [{"name": "resume", "strategy": strategy, "steps": KILL_STEPS, "ckpt": ck, "resume": "last"},
            {"name": "ref", "strategy": strategy, "steps": KILL_STEPS,
             "ckpt": {"dirpath": str(out / "ref_ckpts"), "every": KILL_EVERY}}]
    if strategy.endswith("nvme"):  # the killed run's swap directory (its owner is dead) is in the same nvme_path
        (out / "resumed").mkdir(parents=True, exist_ok=True)
        nvme = out / "killed" / "nvme"
        if nvme.is_dir() and not (out / "resumed" / "nvme").exists():
            (out / "resumed" / "nvme").symlink_to(nvme, target_is_directory=True)
    resumed = launch(out / "resumed", plan, "torchrun")
    return KillResume(killed, resumed, ckpt, listing)


def _run_case(case: str, out: Path) -> Any:
    return _kill_case(case, out) if case.startswith("kill-") else _fault_case(case, out)


class Cases:
    def __init__(self, base: Path, wanted: list[str]) -> None:
        self.base = base
        self.wanted = wanted
        self.done: dict[str, Any] = {}

    def _launch_all(self) -> None:
        todo = [c for c in self.wanted if c not in self.done]
        jobs = max(1, int(os.environ.get("FAULTS_JOBS", "2")))
        # the kill cases are the longest: start them first
        todo.sort(key=lambda c: not c.startswith("kill-"))
        with ThreadPoolExecutor(jobs) as pool:
            for case, result in zip(todo, pool.map(lambda c: _run_case(c, self.base / c), todo)):
                self.done[case] = result

    def __call__(self, case: str) -> Any:
        if case not in self.done:
            if case not in self.wanted:
                self.wanted.append(case)
            self._launch_all()
        return self.done[case]


_WANTED: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """The cases of the tests that will run (after -k/-m deselection)."""
    for item in session.items:
        callspec: Optional[Any] = getattr(item, "callspec", None)
        case = callspec.params.get("case") if callspec is not None else None
        if isinstance(case, str) and str(item.fspath).startswith(str(Path(__file__).parent)) and case not in _WANTED:
            _WANTED.append(case)


@pytest.fixture(scope="session")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    return Cases(tmp_path_factory.mktemp("faults"), list(_WANTED))
