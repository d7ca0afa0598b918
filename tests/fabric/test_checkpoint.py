"""Fabric checkpoints in the sharded format: saved under zero3 on 2 ranks, resumed exactly under
Fabric zero2 on 3 ranks and under the Trainer; consolidated offline and read by ``fabric.load_raw``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import consolidate, is_sharded_checkpoint
from tests.helpers.launch import run_worker

SCENARIO = "fabric.runs"
COMMON = "accum=2,clip=0.5"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """2 ranks: zero3 trains 6 steps, saving after step 3; a Trainer on ZeroStrategy(stage=3) then resumes
    that checkpoint for steps 4-5 in the same job."""
    tmp = tmp_path_factory.mktemp("fabric_ckpt")
    runs = run_worker(tmp, 2, {
        "a": f"zero3:steps=6,save=3,{COMMON}",
        "trainer": f"trainer-zero3:steps=2,first=4,load=a_ckpt,{COMMON}",
    }, timeout=900, scenario=SCENARIO)
    return tmp, runs


def test_the_checkpoint_is_a_sharded_directory(saved: tuple[Path, dict[str, dict]]) -> None:
    tmp, _ = saved
    assert is_sharded_checkpoint(tmp / "a_ckpt")
    assert sorted(p.name for p in (tmp / "a_ckpt").glob("*.distcp"))  # written by every rank


def test_zero3_on_2_ranks_resumes_exactly_under_zero2_on_3(saved: tuple[Path, dict[str, dict]]) -> None:
    tmp, runs = saved
    b = run_worker(tmp, 3, {"b": f"zero2:steps=2,first=4,load={tmp / 'a_ckpt'},{COMMON}"}, scenario=SCENARIO)["b"]
    a = runs["a"]
    assert b["losses"] == pytest.approx(a["losses"][8:], abs=1e-5)  # steps 4 and 5, 2 micro-batches each
    assert b["norms"] == pytest.approx(a["norms"][4:], rel=1e-5)
    for k, v in a["weights"].items():
        torch.testing.assert_close(b["weights"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_the_trainer_resumes_a_fabric_checkpoint_exactly(saved: tuple[Path, dict[str, dict]]) -> None:
    _, runs = saved
    a, t = runs["a"], runs["trainer"]
    assert t["losses"] == pytest.approx(a["losses"][8:], abs=1e-5)
    for k, v in a["weights"].items():
        torch.testing.assert_close(t["weights"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_load_raw_reads_the_consolidated_file(saved: tuple[Path, dict[str, dict]]) -> None:
    tmp, _ = saved
    out = consolidate(tmp / "a_ckpt", tmp / "a_full.ckpt", progress=False)
    full = torch.load(out, weights_only=False)
    assert full["step"] == 3  # the Fabric state's own entries come along
    r = run_worker(tmp, 2, {"r": f"zero3:steps=1,raw={out},{COMMON}"}, scenario=SCENARIO)["r"]
    for k, v in full["state_dict"].items():
        torch.testing.assert_close(r["weights0"][k], v, msg=k)
