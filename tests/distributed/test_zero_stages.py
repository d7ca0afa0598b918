"""ZeRO stages 0/1/2 against Lightning's own ``ddp`` on CPU/gloo: losses, weights, memory, resume, fp16.

One ``torchrun`` per world size trains every configuration in one process group (start-up is the
expensive part on a 2-core CI machine); the tests below only read the results. The 3-rank launch is shared
with test_zero3.py (tests/distributed/conftest.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_worker
from tests.helpers.compare import max_rel as _rel

STAGES = ["zero0", "zero1", "zero2"]


def _weights_rel(w: dict, ref: dict) -> dict[str, float]:
    assert set(w) == set(ref)
    return {k: float((w[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp_min(1e-12)) for k in ref}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {"ddp": "ddp", **{s: s for s in STAGES}}
    # the other optimizers' parity pairs need no trajectory: 10 steps (the LR warm-up and into its decay)
    runs.update({"ddp_sgd": "ddp:opt=sgd,steps=10", "zero2_sgd": "zero2:opt=sgd,steps=10",
                 "zero1_adam": "zero1:opt=adam,accumulate=1,steps=10", "ddp_adam": "ddp:opt=adam,accumulate=1,steps=10"})
    runs.update({
        "fp16": "zero2:precision=16-mixed,inject=3,hysteresis=1,steps=8,clip=0",
        "bf16": "zero2:precision=bf16-mixed,steps=30",
        "resume": "zero2:n_train=160,steps=20,resume=1",
        "resume_full": "zero2:n_train=160,steps=20,resume=1,ckpt=full",
    })
    return run_worker(tmp_path_factory.mktemp("zero2ranks"), 2, runs, timeout=1200)


@pytest.mark.parametrize("stage", STAGES)
def test_losses_and_weights_match_ddp(two_ranks: dict[str, dict], stage: str) -> None:
    ref, got = two_ranks["ddp"], two_ranks[stage]
    assert len(got["losses"]) >= 60  # 30 steps x 2 accumulated micro-batches
    assert _rel(got["losses"], ref["losses"]) < 1e-4
    bad = {k: v for k, v in _weights_rel(got["weights"], ref["weights"]).items() if v > 1e-4}
    assert not bad, bad
    # every rank, not only rank 0, follows ddp
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):
        assert _rel(r_got["losses"], r_ref["losses"]) < 1e-4


def test_training_actually_moved_the_weights(two_ranks: dict[str, dict]) -> None:
    losses = two_ranks["zero2"]["losses"]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10


@pytest.mark.parametrize("name,ref", [("zero2_sgd", "ddp_sgd"), ("zero1_adam", "ddp_adam")])
def test_other_optimizers_match_ddp(two_ranks: dict[str, dict], name: str, ref: str) -> None:
    assert _rel(two_ranks[name]["losses"], two_ranks[ref]["losses"]) < 1e-4
    assert max(_weights_rel(two_ranks[name]["weights"], two_ranks[ref]["weights"]).values()) < 1e-4


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_uneven_partitions_on_three_ranks(three_ranks: dict[str, dict], stage: str) -> None:
    """``three_ranks``: tests/distributed/conftest.py (one 3-rank launch with stage 3's)."""
    assert len(three_ranks[stage]["losses"]) == len(three_ranks["ddp"]["losses"]) > 0
    assert _rel(three_ranks[stage]["losses"], three_ranks["ddp"]["losses"]) < 1e-4
    assert max(_weights_rel(three_ranks[stage]["weights"], three_ranks["ddp"]["weights"]).values()) < 1e-4


def test_optimizer_state_is_partitioned(two_ranks: dict[str, dict]) -> None:
    ddp = max(r["state_bytes"] for r in two_ranks["ddp"]["per_rank"])
    assert ddp > 0
    assert max(r["state_bytes"] for r in two_ranks["zero0"]["per_rank"]) >= ddp  # stage 0 replicates
    for stage in ("zero1", "zero2"):
        per_rank = [r["state_bytes"] for r in two_ranks[stage]["per_rank"]]
        assert all(0.4 * ddp < b < 0.6 * ddp for b in per_rank), (stage, per_rank, ddp)


def test_gradients_are_partitioned_in_stage2(two_ranks: dict[str, dict]) -> None:
    ddp = max(r["grad_bytes"] for r in two_ranks["ddp"]["per_rank"])
    z2 = [r["grad_bytes"] for r in two_ranks["zero2"]["per_rank"]]
    assert all(0.4 * ddp < b < 0.6 * ddp for b in z2), (z2, ddp)
    z1 = [r["grad_bytes"] for r in two_ranks["zero1"]["per_rank"]]
    assert all(b >= ddp for b in z1)  # stage 1 keeps full gradients until they are reduced


@pytest.mark.parametrize("name", ["resume", "resume_full"])
def test_resume_continues_like_an_uninterrupted_run(two_ranks: dict[str, dict], name: str) -> None:
    run = two_ranks[name]
    assert len(run["resumed_losses"]) == 20
    assert _rel(run["resumed_losses"], run["losses"][-20:]) < 1e-6


def test_bf16_mixed_keeps_16bit_weights_and_trains(two_ranks: dict[str, dict]) -> None:
    run = two_ranks["bf16"]
    assert run["trace"][-1]["dtype"] == "torch.bfloat16"
    assert all(w.dtype == torch.float32 for w in run["weights"].values())  # checkpoint: fp32 masters
    assert _rel(run["losses"], two_ranks["zero2"]["losses"]) < 0.05
    assert max(_weights_rel(run["weights"], two_ranks["zero2"]["weights"]).values()) < 0.05


def test_fp16_overflow_skips_the_step_everywhere(two_ranks: dict[str, dict]) -> None:
    run = two_ranks["fp16"]
    trace = run["trace"]
    assert trace[-1]["dtype"] == "torch.float16"
    skipped_at = []
    for prev, cur in zip(trace, trace[1:]):
        if cur["skipped"] > prev["skipped"]:
            skipped_at.append(prev["step"])
            assert cur["params"] == prev["params"], "a skipped step changed the weights"
            assert cur["state"] == prev["state"], "a skipped step changed the optimizer state"
            assert cur["loss_scale"] == prev["loss_scale"] / 2  # hysteresis=1
    assert 3 in skipped_at  # the injected overflow (rank 1 only) was skipped
    assert trace[-1]["params"] != trace[0]["params"]  # and training went on afterwards
    assert all(math.isfinite(x) for x in run["losses"])
    for r in run["per_rank"]:  # both ranks agree on the number of skipped steps
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"])


@pytest.mark.parametrize("run", ["resume", "resume_full"])
def test_checkpoint_loads_into_a_plain_model_and_optimizer(two_ranks: dict[str, dict], run: str,
                                                           tmp_path: Path) -> None:
    """Sharded (the default: a directory, consolidated to one file) and full checkpoints both end up
    readable by Lightning's own loader and a plain torch optimizer."""
    from lightning_zero.checkpoint import consolidate, is_sharded_checkpoint
    from tests.helpers.parity_model import ParityNet

    ckpt = Path(two_ranks[run]["ckpt_dir"]) / "epoch=1-step=20.ckpt"
    assert is_sharded_checkpoint(ckpt) == (run == "resume")
    model = ParityNet.load_from_checkpoint(ckpt, map_location="cpu")  # Lightning's own loader
    for k, v in model.state_dict().items():
        assert torch.equal(v, two_ranks[run]["weights"][k].to(v.dtype)), k
    if run == "resume":
        ckpt = consolidate(ckpt, tmp_path / "one.ckpt", progress=False)
    raw = torch.load(ckpt, map_location="cpu", weights_only=False)
    optimizer = model.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(raw["optimizer_states"][0])  # torch's own per-parameter format
    state = optimizer.state[model.blocks[0].up.weight]
    assert state["exp_avg"].shape == model.blocks[0].up.weight.shape and float(state["step"]) == 20
