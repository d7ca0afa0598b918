"""ZeRO stages with expert parallelism against one process (CPU, gloo, fp32): the MoE GPT of
examples/gpt.py (E=4 experts in every other block, no token dropping, top-1 and top-2), fixed global
batch 8, AdamW, clipping by the global norm at a value that binds, 4 steps; per step the global loss and
the gradient norm (which must count dense and expert parameters once each: zero/shard_comm.py [Note:
gradient norm with experts]), and the final weights of every expert, match the oracle of
tests/moe/zero_ep_worker.py within 1e-4. One ``torchrun`` runs every case of a world size.
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import run_worker
from tests.helpers.compare import max_rel as _rel, tensor_rel

TOL = 1e-4
SCENARIO = "moe.zero_ep"
TWO = {"zero1_top2": ("zero1:ep=2,top_k=2", "ref2"), "zero2_top1": ("zero2:ep=2,top_k=1", "ref1"),
       "zero2_top2": ("zero2:ep=2,top_k=2", "ref2"), "zero3_top1": ("zero3:ep=2,top_k=1", "ref1"),
       "zero3_top2": ("zero3:ep=2,top_k=2", "ref2")}
FOUR = {"zero0_top1": ("zero0:ep=2,top_k=1", "ref1"), "zero2_top2": ("zero2:ep=2,top_k=2", "ref2"),
        "zero3_top1": ("zero3:ep=2,top_k=1", "ref1")}


def _check_parity(got: dict, ref: dict) -> None:
    assert _rel(got["losses"], ref["losses"]) < TOL
    assert _rel(got["norms"], ref["norms"]) < TOL
    assert ref["norms"][0] > 0.5  # clipping binds
    assert set(got["weights"]) == set(ref["weights"])
    for name, w in ref["weights"].items():
        g = got["weights"][name]
        rel = tensor_rel(g, w)
        assert rel < TOL, (name, rel)
    for r in got["per_rank"]:
        assert _rel(r["losses"], ref["losses"]) < TOL


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {name: spec for name, (spec, _) in TWO.items()}
    runs.update({"ref1": "ref:top_k=1", "ref2": "ref:top_k=2"})
    return run_worker(tmp_path_factory.mktemp("moe_zero2"), 2, runs, timeout=900, scenario=SCENARIO)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {name: spec for name, (spec, _) in FOUR.items()}
    runs.update({"ref1": "ref:top_k=1", "ref2": "ref:top_k=2"})
    return run_worker(tmp_path_factory.mktemp("moe_zero4"), 4, runs, timeout=900, scenario=SCENARIO)


@pytest.mark.parametrize("name", list(FOUR))
def test_ep2_x_dp2_on_four_ranks_matches_one_process(four_ranks: dict[str, dict], name: str) -> None:
    """Expert gradients are summed over 2 replicas and divided by 4 (shard_comm.py [Note: expert gradient
    scale]); stage 0's norm weighs dense squares by 1/4 and expert squares by 1/2."""
    _check_parity(four_ranks[name], four_ranks[FOUR[name][1]])
    ranks = four_ranks[name]["per_rank"]
    assert sorted((r["edp_rank"], r["ep_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    stage = int(FOUR[name][0][4])
    assert all(n == (2 if stage else 1) for r in ranks for n in r["expert_shards"])


@pytest.mark.parametrize("name", list(TWO))
def test_ep2_on_two_ranks_matches_one_process(two_ranks: dict[str, dict], name: str) -> None:
    _check_parity(two_ranks[name], two_ranks[TWO[name][1]])


def test_experts_live_on_their_own_ranks(two_ranks: dict[str, dict]) -> None:
    for name in TWO:
        ranks = two_ranks[name]["per_rank"]
        assert sorted(r["ep_rank"] for r in ranks) == [0, 1]
        assert all(r["edp_rank"] == 0 for r in ranks)
        assert all(n == 1 for r in ranks for n in r["expert_shards"])  # EP = world: no expert replicas
        stage = int(TWO[name][0][4])
        assert all(n == (2 if stage else 1) for r in ranks for n in r["dense_shards"])
