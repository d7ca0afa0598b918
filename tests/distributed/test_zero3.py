"""ZeRO stage 3 against Lightning's ``ddp`` on CPU/gloo: parity on 2 and 3 ranks, memory, live units,
sharded initialisation under a memory cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_zero_stages import _rel, _weights_rel
from tests.helpers.harness import run_scenario
from tests.helpers.launch import run_worker

STEPS = 10
"""Steps of the 2-rank runs but the resume's (parity needs no trajectory: tests/distributed/conftest.py)."""


@pytest.fixture(scope="module")
def z3_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    # 10 steps: parity, memory at rest and live units need no trajectory (tests/distributed/conftest.py's note)
    runs = {
        "ddp": f"ddp:steps={STEPS}",
        "zero3": f"zero3:steps={STEPS}",
        "zero3_prefetch2": f"zero3:prefetch=2,steps={STEPS}",
        "zero3_persistent": f"zero3:persist=100000,steps={STEPS}",
        "zero3_resume": "zero3:n_train=160,steps=20,resume=1",
    }
    return run_worker(tmp_path_factory.mktemp("z3two"), 2, runs, timeout=1200)


@pytest.fixture(scope="module")
def z3_three(three_ranks: dict[str, dict]) -> dict[str, dict]:
    """The 3-rank launch shared with test_zero_stages.py (tests/distributed/conftest.py)."""
    return three_ranks


@pytest.mark.parametrize("name", ["zero3", "zero3_prefetch2", "zero3_persistent"])
def test_zero3_matches_ddp_on_two_ranks(z3_two: dict[str, dict], name: str) -> None:
    got, ref = z3_two[name], z3_two["ddp"]
    assert len(got["losses"]) == len(ref["losses"]) == 2 * STEPS  # 2 accumulated micro-batches a step
    assert _rel(got["losses"], ref["losses"]) < 1e-4
    bad = {k: v for k, v in _weights_rel(got["weights"], ref["weights"]).items() if v > 1e-4}
    assert not bad, bad


def test_zero3_matches_ddp_on_three_ranks(z3_three: dict[str, dict]) -> None:
    assert len(z3_three["zero3"]["losses"]) == len(z3_three["ddp"]["losses"]) == 20  # 10 steps x 2 micro-batches
    assert _rel(z3_three["zero3"]["losses"], z3_three["ddp"]["losses"]) < 1e-4
    assert max(_weights_rel(z3_three["zero3"]["weights"], z3_three["ddp"]["weights"]).values()) < 1e-4


def test_zero3_resume(z3_two: dict[str, dict]) -> None:
    run = z3_two["zero3_resume"]
    assert _rel(run["resumed_losses"], run["losses"][-20:]) < 1e-6


@pytest.mark.parametrize("fixture,n", [("z3_two", 2), ("z3_three", 3)])
def test_model_state_at_rest_is_one_nth(request: pytest.FixtureRequest, fixture: str, n: int) -> None:
    runs = request.getfixturevalue(fixture)
    # ddp at rest holds fp32 parameters (4 B), gradients (4 B) and Adam state (8 B) per parameter; the
    # comparable full model state under ZeRO-3 is master (4 B) + Adam state (8 B): 12 of those 16 bytes.
    full = max(r["rest_bytes"] for r in runs["ddp"]["per_rank"]) * 12 / 16
    for r in runs["zero3"]["per_rank"]:
        assert r["rest_bytes"] < 1.2 * full / n, (r["rest_bytes"], full, n)


@pytest.mark.parametrize("name,prefetch", [("zero3", 1), ("zero3_prefetch2", 2)])
def test_live_units_bounded_by_prefetch(z3_two: dict[str, dict], name: str, prefetch: int) -> None:
    for r in z3_two[name]["per_rank"]:
        assert 1 <= r["max_live_units"] <= 1 + prefetch


def test_sharded_init_never_materialises_the_whole_model(tmp_path: Path) -> None:
    run = run_scenario("distributed.sharded_init", nprocs=2, timeout=600, out=tmp_path,
                       env={"MALLOC_MMAP_THRESHOLD_": "65536", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.log[-4000:]
    for rank in range(2):
        rec = run.ranks("result")[rank]
        assert rec["shapes_true"] and rec["resident_param_bytes"] == 0
        # the cap: no rank's memory ever grew by 3/4 of the full model (building it whole costs >= 1x)
        assert rec["peak_extra_bytes"] < 0.75 * rec["full_bytes"], rec
