"""Non-finite steps and failed checkpoint saves (issue #27 items 3 and 4), one 2-rank launch of
scenario ``faults.nonfinite`` (nonfinite_runs.py) running every case in turn (CPU, gloo).

- A NaN loss at global step 2 under fp32 and bf16, stages 1-3 and zero3_offload, with the default
  ``nonfinite='skip'``: the full weights and optimizer states after step 2 equal those before it
  bitwise, skipped_steps is 1, later losses are finite and step 3 trains again; one warning names the step.
- ``max_nonfinite_steps=3`` and NaN at steps 1-3: the run stops with an error saying so.
- ``nonfinite='ignore'`` (NaN weights after step 2) under a top-1 ModelCheckpoint saving every step:
  the save of the NaN weights is refused, the last good checkpoint stays, complete and finite.
- ENOSPC injected into rank 1's checkpoint writer mid-save (a new path, and an overwrite of ``last``):
  no partial directory remains, the earlier checkpoint loads (CRC-checked) with the weights it had,
  and the error is one line naming the checkpoint, the file system, the bytes needed and free and
  the checkpoint kept.
- ``nonfinite='error'`` (the last scenario, not caught): the job exits non-zero naming step 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint.consolidate import load_consolidated
from tests.helpers.harness import run_scenario

SKIP_CASES = [(s, p) for s in ("zero1", "zero2", "zero3", "zero3_offload") for p in ("32-true", "bf16-mixed")]
NAN_AT = 2


def _plan(tmp: Path) -> list[dict[str, Any]]:
    plan: list[dict[str, Any]] = [
        {"name": f"skip-{s}-{p}", "strategy": s, "precision": p, "steps": 4, "nan_at": [NAN_AT], "snap_at": NAN_AT}
        for s, p in SKIP_CASES
    ]
    plan += [
        {"name": "max", "strategy": "zero2", "steps": 6, "nan_at": [1, 2, 3], "zero": {"max_nonfinite_steps": 3}},
        {"name": "ckpt", "strategy": "zero2", "steps": 5, "nan_at": [NAN_AT], "zero": {"nonfinite": "ignore"},
         "ckpt": str(tmp / "top"), "save_at": {"2": str(tmp / "probe/at2")}},
        {"name": "enospc", "strategy": "zero2", "steps": 4, "dir": str(tmp / "ck"), "enospc": 2,
         "save_at": {"1": str(tmp / "ck/a"), "2": str(tmp / "ck/b")}},
        {"name": "enospc_over", "strategy": "zero3", "steps": 4, "dir": str(tmp / "ck2"), "enospc": 2,
         "save_at": {"1": str(tmp / "ck2/last"), "2": str(tmp / "ck2/last")}},
        {"name": "error", "strategy": "zero1", "steps": 4, "nan_at": [NAN_AT], "zero": {"nonfinite": "error"},
         "uncaught": True},
    ]
    return plan


class Run:
    def __init__(self, tmp: Path, returncode: int, log: str, names: list[str]) -> None:
        self.tmp, self.returncode, self.log = tmp, returncode, log
        self.results: dict[str, list[dict[str, Any]]] = {}
        for name in names:
            paths = [tmp / f"{name}.rank{r}.pt" for r in range(2)]
            if all(p.exists() for p in paths):
                self.results[name] = [torch.load(p, weights_only=False) for p in paths]

    def ranks(self, name: str) -> list[dict[str, Any]]:
        assert name in self.results, f"{name}: no results (exit {self.returncode})\n{self.log[-6000:]}"
        return self.results[name]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("nonfinite")
    plan = _plan(tmp)
    proc = run_scenario("faults.nonfinite", nprocs=2, params={"plan": plan}, timeout=900, out=tmp,
                        env={"CUDA_VISIBLE_DEVICES": ""})
    return Run(tmp, proc.returncode, proc.log, [s["name"] for s in plan])


@pytest.mark.slow
@pytest.mark.parametrize("strategy,precision", SKIP_CASES)
def test_nan_step_is_skipped_and_training_goes_on(run: Run, strategy: str, precision: str) -> None:
    for r in run.ranks(f"skip-{strategy}-{precision}"):
        assert r["exc_type"] is None, r.get("error")
        assert r["same_weights"] and r["same_state"] and r["state_tensors"] > 0, r
        assert r["finite_after"] and r["moved_on"], r
        assert r["skipped_steps"] == 1 and r["skipped"][NAN_AT] == 0 and r["skipped"][NAN_AT + 1] == 1, r["skipped"]
        later = [loss for step, loss in r["losses"] if step > NAN_AT]
        assert later and all(math.isfinite(v) for v in later), r["losses"]
    warned = run.ranks(f"skip-{strategy}-{precision}")[0]["warnings"]
    assert len(warned) == 1 and f"at step {NAN_AT}" in warned[0] and "param group 0" in warned[0], warned


@pytest.mark.slow
def test_max_nonfinite_steps_stops_the_run(run: Run) -> None:
    for r in run.ranks("max"):
        assert r["exc_type"] == "NonFiniteStepError", r
        assert "3 non-finite steps in a row (max_nonfinite_steps=3)" in r["exc_msg"] and "at step 3" in r["exc_msg"]


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved_and_the_last_good_checkpoint_survives(run: Run) -> None:
    ranks = run.ranks("ckpt")
    for r in ranks:
        assert r["exc_type"] == "NonFiniteCheckpointError", r
        assert "NaN or inf" in r["exc_msg"] and "step=3.ckpt" in r["exc_msg"] and "step=2.ckpt is kept" in r["exc_msg"]
    top = run.tmp / "top"
    assert sorted(os.listdir(top)) == ["step=2.ckpt"]
    good = load_consolidated(top / "step=2.ckpt")
    expected = ranks[0]["weights_at"][2]
    for k, v in expected.items():
        assert torch.equal(good["state_dict"][k], v), k
    for t in _tensors(good):
        assert torch.isfinite(t).all()


@pytest.mark.slow
@pytest.mark.parametrize("name,kept", [("enospc", "ck/a"), ("enospc_over", "ck2/last")])
def test_disk_full_during_save(run: Run, name: str, kept: str) -> None:
    ranks = run.ranks(name)
    target = run.tmp / ("ck/b" if name == "enospc" else "ck2/last")
    for r in ranks:
        assert r["exc_type"] == "CheckpointSaveError", r
        msg = r["exc_msg"]
        assert "\n" not in msg
        for part in (str(target), "No space left on device (ENOSPC)", "on file system /", "the checkpoint needs",
                     "were free", f"previous checkpoint {run.tmp / kept} is kept"):
            assert part in msg, (part, msg)
    directory = (run.tmp / kept).parent
    assert sorted(os.listdir(directory)) == [Path(kept).name]  # no .lz-partial-*
    ckpt = load_consolidated(run.tmp / kept)  # every item's CRC-32 checked
    for k, v in ranks[0]["weights_at"][1].items():
        assert torch.equal(ckpt["state_dict"][k], v), k


@pytest.mark.slow
def test_nonfinite_error_exits_nonzero_naming_the_step(run: Run) -> None:
    assert run.returncode not in (0, None), run.log[-4000:]
    lines = [ln for ln in run.log.splitlines() if "NonFiniteStepError" in ln and f"at step {NAN_AT}" in ln]
    assert lines and "nonfinite='error'" in lines[0], run.log[-4000:]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
