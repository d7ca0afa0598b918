"""Sharded checkpoints of tensor parallel x ZeRO resume on other layouts (CPU, gloo, fp32; issue #17 item 5).

The writers: HF Llama (tp_worker.py's), dp 2 x tp 2 on 4 processes, ZeRO stages 1, 2 and 3, 2 epochs
of 3 fixed global batches, ModelCheckpoint at each epoch's end (the Trainer's own path; stage 1's
written asynchronously, checkpoint_async=True). Their step-3 directories are resumed on 2 processes
(dp 2 x tp 1: stage 1's under stage 1, stage 2's under stage 3, stage 3's under stage 1), on 1 process
(stage 2's and stage 3's, under stage 2), by Fabric on dp 1 x tp 2 (stage 2's), and a dp 2 x tp 1
re-save resumes on dp 1 x tp 2 (a flat checkpoint read into TP shards). Checked:

* the weights each resumed run starts from equal the writer's at the save, bit for bit;
* the steps after the resume match the uninterrupted run's losses within 1e-6;
* the consolidated writer (``load_consolidated`` and the ``consolidate`` CLI) holds the full weights,
  bit for bit, and its Adam state equals, bit for bit, a re-save's consolidated on another layout;
* ``checkpoint_format="full"`` under TP: a consolidated file resumes into TP blocks, exactly, and the
  full file a TP run writes equals it;
* a checkpoint of another model is one clear error before training.

Three launches (4, 2, 1 processes), about 60 s on 2 busy cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import consolidate, load_consolidated
from lightning_zero.checkpoint.__main__ import main as checkpoint_cli
from tests.helpers.launch import run_worker

SCENARIO = "parallel.tp_ckpt"
STEP3 = "epoch=0-step=3.ckpt"
LOSS_TOL = 1e-6
RESUMES = {  # resumed run -> its writer
    "r1": "s1", "r3": "s2", "one2": "s2", "back": "s1", "r3to1": "s3", "one3": "s3", "full": "s2",
}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_ckpt")


@pytest.fixture(scope="module")
def runs(out: Path) -> dict[str, dict]:
    """Every launch, in order (each reads what the previous wrote)."""
    res = run_worker(out, 4, {"s1": "save:stage=1,tp=2,async=1", "s2": "save:stage=2,tp=2", "s3": "save:stage=3,tp=2"},
                     timeout=600, scenario=SCENARIO)
    consolidate(out / "s2" / STEP3, out / "s2_full.ckpt", progress=False)
    res |= run_worker(out, 2, {
        "r1": f"resume:stage=1,tp=1,ckpt=s1/{STEP3}",
        "r3": f"resume:stage=3,tp=1,ckpt=s2/{STEP3}",
        "back": "resume:stage=2,tp=2,ckpt=r1.ckpt",
        "r3to1": f"resume:stage=1,tp=1,ckpt=s3/{STEP3}",
        "full": "resume:stage=2,tp=2,fmt=full,ckpt=s2_full.ckpt",
        "fab": f"fabric:stage=1,tp=2,ckpt=s2/{STEP3}",
    }, timeout=600, scenario=SCENARIO)
    res |= run_worker(out, 1, {
        "one2": f"resume:stage=2,tp=1,ckpt=s2/{STEP3}",
        "one3": f"resume:stage=2,tp=1,ckpt=s3/{STEP3}",
        "mismatch": f"mismatch:stage=2,tp=1,ckpt=s2/{STEP3}",
    }, timeout=600, scenario=SCENARIO)
    return res


def _assert_bitwise(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str) -> None:
    assert ref and set(got) >= set(ref), (where, sorted(set(ref) - set(got))[:5])
    bad = [k for k in ref if not (got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]))]
    assert not bad, (where, bad[:5])


def test_writers_ran_dp2_x_tp2(runs: dict[str, dict]) -> None:
    for name in ("s1", "s2", "s3"):
        coords = sorted((r["dp_rank"], r["tp_rank"]) for r in runs[name]["per_rank"])
        assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert sorted(runs[name]["losses"]) == list(range(6))
        assert len(runs[name]["saved_weights"]) == 21  # every parameter, full: 2 layers x 9 + embed, norm, head


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_on_another_layout_is_exact(runs: dict[str, dict], name: str) -> None:
    got, ref = runs[name], runs[RESUMES[name]]
    assert got["start"]["step"] == 3
    _assert_bitwise(got["start"]["weights"], ref["saved_weights"], name)
    assert sorted(got["losses"]) == [3, 4, 5]
    rel = {s: abs(got["losses"][s] - ref["losses"][s]) / abs(ref["losses"][s]) for s in got["losses"]}
    assert max(rel.values()) < LOSS_TOL, (name, rel)


def test_layouts_of_the_resumes(runs: dict[str, dict]) -> None:
    assert {(r["dp"], r["tp"]) for r in runs["r1"]["per_rank"]} == {(2, 1)}
    assert {(r["dp"], r["tp"]) for r in runs["back"]["per_rank"]} == {(1, 2)}
    assert len(runs["one2"]["per_rank"]) == 1


def test_consolidated_is_the_full_model(runs: dict[str, dict], out: Path) -> None:
    for name in ("s1", "s2", "s3"):
        ckpt = load_consolidated(out / name / STEP3)
        _assert_bitwise(ckpt["state_dict"], runs[name]["saved_weights"], name)
        assert set(ckpt["state_dict"]) == set(runs[name]["saved_weights"])
    dst = out / "s2_full.ckpt"
    assert checkpoint_cli(["consolidate", str(out / "s2" / STEP3), str(dst), "--no-progress"]) == 0
    ckpt = torch.load(dst, weights_only=False)
    _assert_bitwise(ckpt["state_dict"], runs["s2"]["saved_weights"], "cli")
    assert ckpt["global_step"] == 3


def _assert_same_optimizer(got: dict, ref: dict, where: str) -> None:
    assert set(got["state"]) == set(ref["state"]) and len(ref["state"]) == 21, where
    for i, st in ref["state"].items():
        assert set(got["state"][i]) == set(st) == {"step", "exp_avg", "exp_avg_sq"}, (where, i)
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][key]), torch.as_tensor(v)), (where, i, key)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in ref["param_groups"]], where


@pytest.mark.parametrize("resave,writer", [("r1", "s1"), ("one2", "s2"), ("back", "s1"), ("r3to1", "s3")])
def test_optimizer_state_survives_the_layout_change(out: Path, runs: dict[str, dict], resave: str, writer: str) -> None:
    """A resumed run's checkpoint of the state as loaded (tp 1 re-saves a tp 2 writer's and vice versa)
    holds the writer's Adam moments and steps, bit for bit."""
    ref = load_consolidated(out / writer / STEP3)["optimizer_states"][0]
    got = load_consolidated(out / f"{resave}.ckpt")["optimizer_states"][0]
    _assert_same_optimizer(got, ref, resave)
    ex = ref["state"][next(iter(ref["state"]))]["exp_avg"]
    assert ex.dim() == 2  # moments come back in the parameter's full shape


def test_fabric_loads_and_saves_tp(out: Path, runs: dict[str, dict]) -> None:
    _assert_bitwise(runs["fab"]["weights"], runs["s2"]["saved_weights"], "fabric load")
    ckpt = load_consolidated(out / "fab.ckpt")
    _assert_bitwise(ckpt["state_dict"], runs["s2"]["saved_weights"], "fabric save")
    _assert_same_optimizer(ckpt["optimizer_states"][0], load_consolidated(out / "s2" / STEP3)["optimizer_states"][0], "fabric")
    assert ckpt["step"] == 3


def test_another_model_is_one_clear_error(runs: dict[str, dict]) -> None:
    got = runs["mismatch"]
    assert got["error"] == "ValueError", got
    assert "differ in shape" in got["message"] and "mlp.gate_proj.weight' saved [64, 32], model [96, 32]" in got["message"]


def test_full_format_under_tp(out: Path, runs: dict[str, dict]) -> None:
    """checkpoint_format='full' on dp 1 x tp 2: the consolidated file of the dp 2 x tp 2 writer loads into
    the TP blocks (weights and Adam state: the resume above is exact) and the run's own full file, its
    blocks gathered over tp, equals that file bit for bit."""
    ref = torch.load(out / "s2_full.ckpt", weights_only=False)
    got = torch.load(out / "full.ckpt", weights_only=False)
    assert (out / "full.ckpt").is_file() and set(got["state_dict"]) == set(ref["state_dict"])
    _assert_bitwise(got["state_dict"], ref["state_dict"], "full save")
    _assert_same_optimizer(got["optimizer_states"][0], ref["optimizer_states"][0], "full save")
