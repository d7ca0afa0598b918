"""Sharded checkpoints of expert-parallel runs resume at other EP sizes (CPU, gloo, fp32; issue #20 item 3).

The writers: the MoE GPT of zero_ep_worker.py (4 experts, top-2, no dropping), 2 epochs of 2 fixed global
batches, ModelCheckpoint at each epoch's end (the Trainer's own path), under EP 2 on 2 ranks (stages 2 and
3: experts unpartitioned, one EP rank each), EP 2 x DP 2 on 4 ranks (stage 2: experts partitioned over
their 2 replicas) and EP 1 on 2 ranks (stage 1). Their step-2 directories are resumed:

* EP 2 -> EP 1 (dp 2; stages 2 and 3), EP 1 -> EP 2 (stage 1 -> 2), EP 2 x DP 2 -> the same under stage 0
  (expert states split evenly over their replicas when re-saved), by Fabric (EP 2, stage 3), and in one
  process with plain torch from the consolidated file (the single-process model of all experts);
* the weights each resumed run starts from equal the writer's at the save, bit for bit; its Adam state,
  re-saved at the start and consolidated, equals the writer's consolidated, bit for bit;
* the steps after the resume match the uninterrupted writer's losses within 1e-6 (the same EP: exactly);
* the consolidated checkpoint (``load_consolidated``, the CLI) is the single-process model's state dict:
  its names, in its order, and every expert's values;
* the full format under EP > 1 is refused, saying what to use.

Two launches (4 and 2 processes), about 60 s on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import load_consolidated
from lightning_zero.checkpoint.__main__ import main as checkpoint_cli
from tests.helpers.launch import run_worker

SCENARIO = "moe.ckpt_ep"
STEP2 = "epoch=0-step=2.ckpt"
LOSS_TOL = 1e-6
RESUMES = {"r2": "s2", "r3": "s3", "up": "d1", "q0": "q2"}  # resumed run -> its writer
SAME_EP = {"q0"}
N_WEIGHTS = 23  # embeddings, 2 blocks (one with a gate and 4 experts of 2 matrices), final norm, head


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep_ckpt")


@pytest.fixture(scope="module")
def runs(out: Path) -> dict[str, dict]:
    res = run_worker(out, 4, {"q2": "save:stage=2,ep=2", "q0": f"resume:stage=0,ep=2,ckpt=q2/{STEP2}"},
                     timeout=600, scenario=SCENARIO)
    res |= run_worker(out, 2, {
        "s2": "save:stage=2,ep=2",
        "s3": "save:stage=3,ep=2",
        "d1": "save:stage=1,ep=1",
        "r2": f"resume:stage=2,ep=1,ckpt=s2/{STEP2}",
        "r3": f"resume:stage=3,ep=1,ckpt=s3/{STEP2}",
        "up": f"resume:stage=2,ep=2,ckpt=d1/{STEP2}",
        "fab": f"fabric:stage=3,ep=2,ckpt=s2/{STEP2}",
        "one": f"oracle:ckpt=s2/{STEP2}",
    }, timeout=600, scenario=SCENARIO)
    return res


def _assert_bitwise(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str) -> None:
    assert len(ref) == N_WEIGHTS and set(got) == set(ref), (where, sorted(set(ref) ^ set(got))[:5])
    bad = [k for k in ref if not (got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]))]
    assert not bad, (where, bad[:5])


def _rel(got: dict[int, float], ref: dict[int, float]) -> float:
    return max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)


def test_writers_ran_their_layouts(runs: dict[str, dict]) -> None:
    assert sorted((r["edp_rank"], r["ep_rank"]) for r in runs["q2"]["per_rank"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(r["ep_rank"] for r in runs["s2"]["per_rank"]) == [0, 1]
    assert {r["ep"] for r in runs["d1"]["per_rank"]} == {1} and {r["ep"] for r in runs["r2"]["per_rank"]} == {1}
    assert {r["ep"] for r in runs["up"]["per_rank"]} == {2} and {r["ep"] for r in runs["fab"]["per_rank"]} == {2}
    for name in ("q2", "s2", "s3", "d1"):
        assert sorted(runs[name]["losses"]) == [0, 1, 2, 3]
    experts = runs["s2"]["saved_weights"]
    fc = [experts[f"model.blocks.1.mlp.experts.{i}.fc.weight"] for i in range(4)]
    assert all(not torch.equal(fc[i], fc[j]) for i in range(4) for j in range(i))  # a mix-up would show


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_at_another_ep_size_is_exact(runs: dict[str, dict], name: str) -> None:
    got, ref = runs[name], runs[RESUMES[name]]
    assert got["start"]["step"] == 2
    _assert_bitwise(got["start"]["weights"], ref["saved_weights"], name)
    assert sorted(got["losses"]) == [2, 3]
    assert _rel(got["losses"], ref["losses"]) < LOSS_TOL, (name, got["losses"], ref["losses"])
    if name in SAME_EP:
        assert got["losses"] == {s: ref["losses"][s] for s in (2, 3)}


def _assert_same_optimizer(got: dict, ref: dict, where: str) -> None:
    assert set(got["state"]) == set(ref["state"]) and len(ref["state"]) == N_WEIGHTS, where
    for i, st in ref["state"].items():
        assert set(got["state"][i]) == set(st) == {"step", "exp_avg", "exp_avg_sq"}, (where, i)
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][key]), torch.as_tensor(v)), (where, i, key)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in ref["param_groups"]], where


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_optimizer_state_survives_the_ep_change(out: Path, name: str) -> None:
    """The state as loaded, re-saved at the resumed run's start, holds the writer's Adam moments and steps."""
    ref = load_consolidated(out / RESUMES[name] / STEP2)["optimizer_states"][0]
    _assert_same_optimizer(load_consolidated(out / f"{name}.ckpt")["optimizer_states"][0], ref, name)


def test_consolidated_is_the_single_process_state_dict(runs: dict[str, dict], out: Path) -> None:
    names = runs["one"]["single_process_names"]
    for writer in ("q2", "s2", "s3", "d1"):
        ckpt = load_consolidated(out / writer / STEP2)
        assert list(ckpt["state_dict"]) == names, writer
        _assert_bitwise(ckpt["state_dict"], runs[writer]["saved_weights"], writer)
        opt = ckpt["optimizer_states"][0]
        assert [p for g in opt["param_groups"] for p in g["params"]] == list(range(N_WEIGHTS))
        for i, name in enumerate(names):  # numbered as the single-process optimizer numbers its parameters
            assert opt["state"][i]["exp_avg"].shape == ckpt["state_dict"][name].shape, (writer, name)
    dst = out / "s2_full.ckpt"
    assert checkpoint_cli(["consolidate", str(out / "s2" / STEP2), str(dst), "--no-progress"]) == 0
    ckpt = torch.load(dst, weights_only=False)
    _assert_bitwise(ckpt["state_dict"], runs["s2"]["saved_weights"], "cli")
    assert ckpt["global_step"] == 2


def test_one_process_resumes_the_consolidated_file(runs: dict[str, dict]) -> None:
    """The single-process model of all experts with plain torch AdamW continues the EP-2 run."""
    got = runs["one"]
    assert got["names"] == got["single_process_names"]
    assert sorted(got["losses"]) == [2, 3]
    assert _rel(got["losses"], runs["s2"]["losses"]) < LOSS_TOL, (got["losses"], runs["s2"]["losses"])


def test_fabric_loads_and_saves_experts_by_global_index(out: Path, runs: dict[str, dict]) -> None:
    _assert_bitwise(runs["fab"]["weights"], runs["s2"]["saved_weights"], "fabric load")
    ckpt = load_consolidated(out / "fab.ckpt")
    _assert_bitwise(ckpt["state_dict"], runs["s2"]["saved_weights"], "fabric save")
    _assert_same_optimizer(ckpt["optimizer_states"][0], load_consolidated(out / "s2" / STEP2)["optimizer_states"][0],
                           "fabric")
    assert ckpt["step"] == 2


def test_full_format_under_ep_is_refused_clearly(runs: dict[str, dict]) -> None:
    for name in ("up", "q0"):
        for r in runs[name]["per_rank"]:
            assert "expert_parallel=2 is not built yet" in r["full_refused"], name
            assert "checkpoint_format='sharded'" in r["full_refused"]
