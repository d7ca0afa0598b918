"""Tensor-parallel predict (issue #31): ``ZeroStrategy(tensor_parallel=2)`` on 2 gloo ranks, no ``fit``, the
ready TP plans applied in ``configure_model``, against tp 1 (the plain model, which the evaluation-only
runs of test_predict.py match exactly): logits within fp32 rounding of the split matmuls' sums, and the
same ``generate`` tokens (KV cache through HF's cache for Llama, through the hook for our GPT; compiled with
a static cache too, refused under stage 3). Under
stage 3 the evaluation engine partitions each rank's TP shards over the data-parallel ranks (here 1)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import run_scenario

RUNS = ["gpt:3", "llama:3", "llama:1"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run = run_scenario("inference.tp_predict", nprocs=2, params={"runs": RUNS},
                       out=tmp_path_factory.mktemp("tp_predict"), timeout=600).check()
    return run.ranks("result")


@pytest.mark.parametrize("spec", RUNS)
def test_tp2_predict_equals_tp1(ranks: list[dict], spec: str) -> None:
    stage = int(spec.split(":")[1])
    for rank in ranks:
        r = rank[spec]
        assert r["engines"] == (["InferenceEngine"] if stage == 3 else [])
        assert len(r["rows"]) == 2  # dp 1: both ranks predict every batch
        for row in r["rows"]:
            assert row["sharded"] > 0  # the plan split parameters into DTensors
            assert row["diff"] <= 1e-5, row["diff"]  # fp32 rounding of the split matmuls' sums
            assert torch.equal(row["tokens"], row["plain_tokens"])
            if stage == 3:  # refused: the engine's gather hooks swap storages (none emptied at dp 1)
                assert row["compiled"] is None
            else:  # the compiled decode (static cache of the local heads) over the TP shards
                assert torch.equal(row["compiled"], row["plain_tokens"])
