"""What ``trainer.fit`` hands back under ``bf16-mixed`` (lightning_zero/after_fit.py [Note: the module after fit]):
as after ddp, the user's module in the dtypes they built it in, holding the fp32 masters, on the CPU; after
``validate`` again; and a second fit starts its masters from exactly those values (2 gloo ranks, ParityNet)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_scenario
from tests.helpers.launch import ACCELERATOR_ENV

CAST = ["zero0", "zero1", "zero2", "zero2_offload"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    specs = [*CAST, "zero2_autocast", "zero3", "zero3_persistent"]
    run = run_scenario("distributed.after_fit", nprocs=2, params={"specs": specs}, timeout=600,
                       out=Path(tmp_path_factory.mktemp("after_fit"))).check()
    return run.ranks("result")


@pytest.mark.parametrize("spec", [*CAST, "zero2_autocast"])
def test_the_module_after_fit_holds_the_fp32_masters(ranks: list[dict], spec: str) -> None:
    for r in ranks:
        got = r[spec]
        assert got["masters_dtypes"] == ["torch.float32"]
        for when in ("after_fit", "after_validate"):
            held = got[when]
            assert held["param_dtypes"] == ["torch.float32"], (when, held)  # not the 16-bit training copy
            assert held["buffer_dtypes"] == {"gain": "torch.float32"}, (when, held)
        assert got["equals_masters"] == got["keys"], sorted(set(got["keys"]) - set(got["equals_masters"]))
        assert got["equals_masters_after_validate"] == got["keys"]
        assert got["after_fit"]["devices"] == ["cpu"]


@pytest.mark.parametrize("spec", [*CAST, "zero2_autocast"])
def test_a_second_fit_starts_from_the_masters(ranks: list[dict], spec: str) -> None:
    """Before after_fit.py the cast layout's second fit started from 16-bit-rounded weights (ddp's from fp32)."""
    for r in ranks:
        assert r[spec]["second_fit_starts_from_masters"] == r[spec]["keys"]


@pytest.mark.parametrize("spec", [*CAST, "zero2_autocast", "zero3", "zero3_persistent"])
def test_frozen_fp32_weights_come_back_exactly_as_built(ranks: list[dict], spec: str) -> None:
    """ParityNet's frozen fp32 Linear computes in bf16 under the cast layout; before frozen_fp32.py the module after
    fit, full_state_dict() and checkpoints held it rounded to bf16 (4.8e-4 off), where ddp keeps it as built. A
    sharded checkpoint resumed into a model built with other values brings back the exact ones, and the 16-bit
    copy the forward uses is their cast."""
    shares = [r[spec]["frozen_share_bytes"] for r in ranks]  # the host copies, counted by storage
    if spec == "zero2_autocast":  # the module stays fp32: nothing to keep
        assert shares == [0, 0]
    else:  # the two ranks' even shares add up to one fp32 copy (the frozen Linear's 552 elements: 275 and 277)
        assert sum(shares) == ranks[0][spec]["frozen_fp32_bytes"] and max(shares) - min(shares) <= 8, shares
    for r in ranks:
        got = r[spec]
        assert got["frozen_masters_as_built"] == ["bias", "weight"], got["frozen_masters_as_built"]
        if not spec.startswith("zero3"):
            assert got["frozen_module_as_built"] == ["bias", "weight"]
            assert got["frozen_after_second_fit"] == ["bias", "weight"]
        resumed = got["frozen_resumed"]  # a sharded checkpoint saved after fit, resumed into another model
        assert resumed["masters"] == ["bias", "weight"], resumed
        if "compute" in resumed:  # the forward's copy (stage 3: a persistent unit's gathered one, refreshed)
            assert resumed["compute"] is True, resumed
        if not spec.startswith("zero3"):
            assert "compute" in resumed and resumed["module"] == ["bias", "weight"], resumed


def test_stage3_still_refuses_the_released_state_dict(ranks: list[dict]) -> None:
    for r in ranks:
        err = r["zero3"]["state_dict_error"]
        assert err is not None and "full_state_dict()" in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_module_comes_back_to_the_cpu_in_fp32(tmp_path: Path) -> None:
    """One GPU: the masters live on the device (or the host under offload); the module comes back on the CPU."""
    env = {ACCELERATOR_ENV: "gpu", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0"}
    specs = ["zero1", "zero2", "zero2_offload"]
    run = run_scenario("distributed.after_fit", nprocs=1, params={"specs": specs}, timeout=600, out=tmp_path,
                       env=env).check()
    (r,) = run.ranks("result")
    for spec in specs:
        assert r[spec]["after_fit"]["param_dtypes"] == ["torch.float32"], r[spec]
        assert r[spec]["after_fit"]["devices"] == ["cpu"] and r[spec]["equals_masters"] == r[spec]["keys"]
        assert r[spec]["second_fit_starts_from_masters"] == r[spec]["keys"]
