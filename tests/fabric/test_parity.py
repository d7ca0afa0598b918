"""Fabric loops on 2 gloo ranks: every ZeRO stage (and stage 3 with CPU offload) follows Fabric's own
``ddp`` step for step, with accumulation under ``no_backward_sync`` and clipping by norm; stage 3
built on the meta device materialises real, rank-consistent weights (a zero2 run resumed from its
step-0 checkpoint continues it exactly)."""

from __future__ import annotations


import pytest
import torch

from tests.helpers.launch import run_worker

SCENARIO = "fabric.runs"
STAGES = ["zero1", "zero2", "zero3", "zero3_offload"]
COMMON = "steps=4,accum=2,clip=0.5"
CLAMP = "steps=3,accum=1,clip=0,clamp=0.02"
"""WGAN's weight clipping after each step (fabric_worker.py ``clamp``)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("fabric_parity")
    specs = {"ddp": f"ddp:{COMMON}", **{s: f"{s}:{COMMON}" for s in STAGES}}
    specs["meta"] = f"zero3:{COMMON},meta=1,save=0"
    specs["after_meta"] = "zero2:steps=3,accum=2,clip=0.5,first=1,load=meta_ckpt"
    specs["bf16"] = "zero2:steps=3,accum=1,clip=0,precision=bf16-mixed"
    specs["fp16"] = "zero2:steps=4,accum=1,clip=0.5,precision=16-mixed,inject=1"
    for kind in ("ddp", "zero1", "zero3"):  # precision.py [Note: clipping by value]
        specs[f"value_{kind}"] = f"{kind}:steps=3,accum=2,clip=0,clip_value=0.01"
    specs["noclip_ddp"] = "ddp:steps=3,accum=2,clip=0"
    for kind, how in (("ddp", ""), ("zero1", ""), ("zero3", ",gathered=1"), ("zero3_offload", ",gathered=1")):
        specs[f"clamp_{kind}"] = f"{kind}:{CLAMP}{how}"
    specs["clamp_refused"] = f"zero3:{CLAMP},refused=1"  # last: it stops inside a step
    return run_worker(tmp, 2, specs, timeout=900, scenario=SCENARIO)


@pytest.mark.parametrize("stage", STAGES)
def test_losses_norms_and_weights_match_fabric_ddp(runs: dict[str, dict], stage: str) -> None:
    ref, got = runs["ddp"], runs[stage]
    assert len(got["losses"]) == len(ref["losses"]) == 8  # 4 steps x 2 micro-batches
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-4)  # what clip_gradients returned
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, atol=1e-4, rtol=1e-4, msg=f"{stage}: {k}")


def test_the_runs_really_trained_and_clipped(runs: dict[str, dict]) -> None:
    ref = runs["ddp"]
    assert len(set(round(x, 4) for x in ref["losses"])) == len(ref["losses"])
    assert all(n > 0.5 for n in ref["norms"])  # clipping was active (max_norm 0.5) in every step


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_clipping_by_value_matches_fabric_ddp(runs: dict[str, dict], stage: str) -> None:
    ref, got, noclip = runs["value_ddp"], runs[f"value_{stage}"], runs["noclip_ddp"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4) and len(ref["losses"]) == 6
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, atol=1e-4, rtol=1e-4, msg=f"{stage}: {k}")
    moved = max(float((v - noclip["weights"][k]).norm() / noclip["weights"][k].norm()) for k, v in ref["weights"].items())
    assert moved > 1e-2, moved  # the clamp was active


def test_stage3_empty_init_builds_on_meta_and_materialises_real_weights(runs: dict[str, dict]) -> None:
    meta, after = runs["meta"], runs["after_meta"]
    assert meta["on_meta"] and not runs["zero3"]["on_meta"]
    assert all(torch.isfinite(v).all() for v in meta["weights"].values() if v.is_floating_point())
    # the weights materialised unit by unit are a model every rank agrees on: its checkpoint after step 0,
    # resumed under zero2, continues the stage-3 run exactly
    assert after["losses"] == pytest.approx(meta["losses"][2:], abs=1e-5)
    for k, v in meta["weights"].items():
        torch.testing.assert_close(after["weights"][k], v, atol=1e-5, rtol=1e-5)


def test_bf16_mixed_keeps_16bit_weights_and_fp32_outputs(runs: dict[str, dict]) -> None:
    run = runs["bf16"]
    assert run["dtypes"] == ["torch.bfloat16"]
    assert all(v.dtype == torch.float32 for v in run["weights"].values() if v.is_floating_point())  # the masters
    assert all(torch.isfinite(torch.tensor(run["losses"])))


def test_fp16_loss_scaling_skips_an_overflow_on_every_rank(runs: dict[str, dict]) -> None:
    run = runs["fp16"]
    assert run["dtypes"] == ["torch.float16"]
    assert run["skipped"] == [0, 1, 1, 1]  # rank 1's infinite loss at step 1 skipped the step everywhere
    assert run["loss_scale"] == 2.0**7  # 2**8 at first, halved once (hysteresis 1)
    assert all(torch.isfinite(v).all() for v in run["weights"].values() if v.is_floating_point())


def test_fabric_collectives(runs: dict[str, dict]) -> None:
    assert runs["zero2"]["broadcast"] == 17  # fabric.broadcast from rank 1
    assert runs["zero2"]["losses"][0] == pytest.approx(runs["ddp"]["losses"][0])  # fabric.all_reduce(mean)


@pytest.mark.parametrize("kind", ["zero1", "zero3", "zero3_offload"])
def test_weights_clamped_after_the_step_follow_fabric_ddp(runs: dict[str, dict], kind: str) -> None:
    """WGAN's ``p.data.clamp_()`` after ``optimizer.step()``: stage 1 follows the write by itself; stage 3 inside
    ``gathered_params(model, writeback=True)``. The clamp binds (ddp's blocks end at the bound)."""
    ref, got = runs["clamp_ddp"], runs[f"clamp_{kind}"]
    blocks = [v for k, v in ref["weights"].items() if k.startswith("blocks.")]
    assert blocks and max(float(v.abs().max()) for v in blocks) == pytest.approx(0.02)
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4)
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, atol=1e-4, rtol=1e-4, msg=f"{kind}: {k}")


def test_stage3_refuses_a_clamp_after_the_step_outside_gathered_params(runs: dict[str, dict]) -> None:
    """Outside ``gathered_params`` the clamp under zero3 wrote into released storage (silently apart from
    ddp); the first step now stops with the error naming the line and the fix."""
    error = runs["clamp_refused"].get("error") or ""
    assert "used after optimizer.step()" in error and "gathered_params(module, writeback=True)" in error, error
    assert "p.data.clamp_" in error
