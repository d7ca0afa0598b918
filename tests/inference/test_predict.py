"""ZeRO-Inference (issue #31): ``predict`` / ``validate`` / ``test`` without ``fit`` under stage 3 on 2 gloo
ranks, partitions on the device, in host memory and in NVMe swap files, on examples/gpt.py's GPT and an HF
Llama: outputs equal to the plain model's, no optimizer built, no optimizer state or trainable partition,
each rank holding half the model; checkpoints saved by and loaded into such runs; then ``fit`` on the same
module; MoQ's export after a stage-3 fit; and ``generate`` inside ``predict_step``
(tokens equal to HF's greedy ``generate`` with and without cache, and to the plain model's). One launch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import run_scenario

MODELS = ("gpt", "llama")
PLACES = ("none", "cpu", "nvme")
EVAL = [f"eval:{k}:{w}" for k in MODELS for w in PLACES]
GENERATE = ["generate:gpt:none", "generate:llama:cpu", "generate:gpt:nvme", "generate:llama:zero2",
            "generate:gpt:zero0"]
CKPT = ["ckpt:gpt:nvme", "ckpt:llama:cpu", "ckpt_meta:gpt:cpu", "ckpt_meta:llama:nvme"]
EOS = ["generate_eos:gpt:cpu", "generate_eos:gpt:zero2"]
RUNS = EVAL + ["fit_after:gpt:none"] + GENERATE + EOS + CKPT + ["moq_export:llama:cpu"]
TOL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run = run_scenario("inference.predict", nprocs=2, params={"runs": RUNS, "tokens": 5},
                       out=tmp_path_factory.mktemp("infer"), timeout=900).check()
    return run.ranks("result")


@pytest.mark.parametrize("spec", EVAL)
def test_evaluation_equals_the_plain_model(ranks: list[dict], spec: str) -> None:
    for rank in ranks:
        r = rank[spec]
        assert r["batches"] == 2 and r["val_batches"] == 2  # 8 samples, batch 2, over 2 ranks
        assert r["predict"] <= TOL and r["val"] <= TOL and r["test"] <= TOL, r


@pytest.mark.parametrize("spec", EVAL)
def test_no_optimizer_state_and_half_the_model_per_rank(ranks: list[dict], spec: str) -> None:
    where = spec.split(":")[2]
    for rank in ranks:
        r = rank[spec]
        assert r["optimizers_built"] == 0  # configure_optimizers never ran
        for facts in (r["after_predict"], r["after_test"]):
            assert facts["engines"] == ["InferenceEngine"]
            assert facts["param_groups"] == 0 and facts["state_bytes"] == 0
            assert facts["trainable_groups"] == 0 and facts["grad_buffers"] == 0  # no masters, no gradients
            numel = facts["model_numel"]
            assert numel / 2 <= facts["partition_numel"] <= numel / 2 + 256  # this rank's half (+ alignment)
            assert facts["param_storage_bytes"] == 0  # every unit released after the step
            assert facts["max_live_units"] <= facts["prefetch_units"] + 1  # the unit running and those prefetched
            if where == "nvme":  # between steps the partitions are in their swap files only
                assert facts["partition_storage_bytes"] == 0 and facts["swap_files"] > 0
            else:
                assert facts["partition_storage_bytes"] >= facts["partition_numel"] * 4
            if where == "cpu":  # the partitions are the host pool's (pinned on a GPU machine)
                assert facts["host_pool_bytes"] >= facts["partition_numel"] * 4
            else:
                assert facts["host_pool_bytes"] == 0


def test_fit_after_predict(ranks: list[dict]) -> None:
    for rank in ranks:
        r = rank["fit_after:gpt:none"]
        assert r["predict"] <= TOL
        assert r["engines"] == ["Stage3Engine"] and r["optimizer"] == "AdamW"
        assert r["optimizers_built"] == 1 and r["steps"] == 1


@pytest.mark.parametrize("spec", CKPT)
def test_checkpoint_saved_by_and_loaded_into_an_evaluation_run(ranks: list[dict], spec: str) -> None:
    """``trainer.save_checkpoint`` after an evaluation-only run holds the partitions' weights; ``predict(...,
    ckpt_path=...)`` on a module built with other weights (``ckpt_meta``: built in configure_model, on the
    meta device, materialised unit by unit) predicts with the checkpoint's."""
    for rank in ranks:
        r = rank[spec]
        if spec.startswith("ckpt_meta"):
            assert r["built_on_meta"]
        else:
            assert r["before"] > 1.0  # the second module's own weights predict something else
        assert r["predict"] <= TOL


@pytest.mark.parametrize("spec", GENERATE)
def test_generate_under_stage3(ranks: list[dict], spec: str) -> None:
    kind = spec.split(":")[1]
    for rank in ranks:
        rows = rank[spec]["rows"]
        assert len(rows) == 2
        for row in rows:
            assert row["cached"].shape == (2, 6 + 5)
            assert torch.equal(row["cached"][:, :6], row["prompt"])
            for key in ("uncached", "plain_cached", "plain_uncached"):
                assert torch.equal(row["cached"], row[key]), key
            if kind == "llama":
                for key in ("hf", "plain_hf", "plain_hf_nocache"):
                    assert torch.equal(row["cached"], row[key]), key


@pytest.mark.parametrize("spec", EOS)
def test_generate_ranks_stop_together_under_stage3(ranks: list[dict], spec: str) -> None:
    """Rank 0's row ends at its first token, rank 1's never does: under stage 3 rank 0 keeps running
    forwards (padding) until rank 1 is done, or the gathers would part them; under stage 2 (no gathers)
    each rank stops on its own."""
    stage3 = not spec.endswith("zero2")
    for r, rank in enumerate(ranks):
        for row in rank[spec]["rows"]:
            got, plain, eos = row["ended"], row["plain_cached"], row["eos"]
            assert plain.shape == (1, 6 + 5)
            if r == 0:
                assert int(got[0, 6]) == eos == int(plain[0, 6])
                assert got.shape == ((1, 6 + 5) if stage3 else (1, 6 + 1)) and got[0, 7:].eq(0).all()
            else:
                assert torch.equal(got, plain)


def test_moq_export_under_stage3(ranks: list[dict]) -> None:
    """MoQ's export at the end of a stage-3 fit with CPU offload (gathered, written by rank 0) loads into a
    quantized model whose logits equal the trained weights' fake-quantized ones, on every rank."""
    for rank in ranks:
        r = rank["moq_export:llama:cpu"]
        assert r["moved"] > 0.1  # two steps moved the weights away from the initial ones
        assert r["diff"] == 0.0
