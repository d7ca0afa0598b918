"""``mixed_precision='autocast'`` (lightning_zero/precision.py [Note: two mixed-precision layouts]): ``bf16-mixed``
under ZeRO stages 1-3 and zero3_offload trains as Lightning's ddp ``bf16-mixed`` does (autocast over fp32 weights),
to fp32 rounding, where the default cast layout differs by design (2 gloo ranks, ParityNet, 12 steps; on one GPU too, gpu-marked)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.compare import max_rel
from tests.helpers.launch import ACCELERATOR_ENV, run_worker

SPECS = {
    "ddp": "ddp:precision=bf16-mixed,steps=12",
    "zero1": "zero1:precision=bf16-mixed,autocast=1,steps=12",
    "zero2": "zero2:precision=bf16-mixed,autocast=1,steps=12",
    "zero3": "zero3:precision=bf16-mixed,autocast=1,steps=12",
    "zero3_offload": "zero3:precision=bf16-mixed,autocast=1,oopt=cpu,oparams=cpu,steps=12",
    "zero2_cast": "zero2:precision=bf16-mixed,steps=12",
}
TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_worker(tmp_path_factory.mktemp("autocast"), 2, SPECS, timeout=900)


def _weights_rel(w: dict, ref: dict) -> float:
    assert set(w) == set(ref) and ref
    return max(float((w[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp_min(1e-12)) for k in ref)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_autocast_layout_trains_as_ddp_bf16_mixed(runs: dict[str, dict], name: str) -> None:
    ref, got = runs["ddp"], runs[name]
    assert len(got["losses"]) == len(ref["losses"]) == 24  # 12 steps x 2 accumulated micro-batches
    assert max_rel(got["losses"], ref["losses"]) < TOL, (got["losses"], ref["losses"])
    assert _weights_rel(got["weights"], ref["weights"]) < TOL
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):
        assert max_rel(r_got["losses"], r_ref["losses"]) < TOL
    assert {t["dtype"] for t in got["trace"]} == {"torch.float32"}  # the module was not cast


def test_the_cast_layout_is_the_control(runs: dict[str, dict]) -> None:
    """The default layout computes from 16-bit weights and reduces 16-bit gradients: further from ddp than the
    tolerance above, so the autocast checks can fail."""
    ref, cast = runs["ddp"], runs["zero2_cast"]
    assert {t["dtype"] for t in cast["trace"]} == {"torch.bfloat16"}
    assert max(max_rel(cast["losses"], ref["losses"]), _weights_rel(cast["weights"], ref["weights"])) > 10 * TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_autocast_layout_on_cuda_trains_as_ddp_bf16_mixed(tmp_path: Path) -> None:
    """The same parity on one GPU: CUDA's autocast and bf16 kernels, and stage 3's gathers of fp32 weights on its
    side streams (what gloo on the CPU does not run). ddp of one rank is the oracle; the cast layout the control."""
    specs = {k: v for k, v in SPECS.items() if k != "zero3_offload"}
    env = {ACCELERATOR_ENV: "gpu", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0"}
    runs = run_worker(tmp_path, 1, specs, timeout=900, env=env)
    ref = runs["ddp"]
    assert {t["device"] for name in specs for t in runs[name]["trace"]} == {"cuda"}  # the batches ran on the GPU
    for name in ("zero1", "zero2", "zero3"):
        got = runs[name]
        assert len(got["losses"]) == len(ref["losses"]) == 24
        assert max_rel(got["losses"], ref["losses"]) < TOL, (name, got["losses"], ref["losses"])
        assert _weights_rel(got["weights"], ref["weights"]) < TOL, name
        assert {t["dtype"] for t in got["trace"]} == {"torch.float32"}
    cast = runs["zero2_cast"]
    assert max(max_rel(cast["losses"], ref["losses"]), _weights_rel(cast["weights"], ref["weights"])) > 10 * TOL
