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
    specs = [*CAST, "zero2_autocast", "zero3"]
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
