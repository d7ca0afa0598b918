"""ZeRO-3's released parameters: ``state_dict()`` / ``load_state_dict()`` outside a gather are refused with the fix
named, and the fixes work (2 gloo ranks; tests/distributed/released_state.py says what each call is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.harness import run_scenario


@pytest.fixture(scope="module", params=["zero3", "zero3_offload"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run = run_scenario("distributed.released_state", nprocs=2, params={"spec": request.param},
                       out=Path(tmp_path_factory.mktemp(f"released_{request.param}")), timeout=300).check()
    return run.ranks("result")


def test_state_dict_of_released_modules_is_refused_naming_the_fix(ranks: list[dict]) -> None:
    """It used to return zero-byte tensors: torch.save wrote them, the load failed later, the weights were lost."""
    for r in ranks:
        for call in ("state_dict", "block_state_dict"):
            assert r[call] is not None, (call, "returned a state dict of released parameters")
            assert "partitioned by ZeRO stage 3" in r[call] and "full_state_dict()" in r[call], r[call]
        assert r["state_dict"].startswith("'") and r["block_state_dict"].startswith("'")  # the parameter is named


def test_load_state_dict_into_released_modules_is_refused(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["load_state_dict"] is not None and "gathered_params(writeback=True)" in r["load_state_dict"]


def test_a_callback_saving_weights_between_steps_stops_fit(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["callback"] is not None and "partitioned by ZeRO stage 3" in r["callback"], r["callback"]


def test_the_named_fixes_give_the_weights(ranks: list[dict]) -> None:
    """``keep_vars=True`` (the strategy's own readers) still lists every name; inside ``gathered_params`` the
    module's state dict is the full one; a load inside ``gathered_params(writeback=True)`` reaches the masters."""
    for r in ranks:
        assert r["keep_vars_names"] == r["full_keys"] and r["full_keys"]
        assert r["gathered_matches_full"]
        assert r["load_written_back"]
