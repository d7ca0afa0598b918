"""Data-dependent control flow (one launch of scenario ``distributed.skipped_units``, skip_runs.py).

Issue #14: under ZeRO-3 a unit skipped on one rank only used to mismatch the gather collectives and
hang; gathers now catch up with the recorded order (stage3.py [Note: units skipped on one rank]) and
training matches ddp. Issue #27 item 8: parameters that no rank used in a step are not stepped, as
torch's optimizers and ddp leave them (zero/unused.py [Note: parameters unused on every rank])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_scenario


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("skip")
    run_scenario("distributed.skipped_units", nprocs=2, timeout=600, out=out, env={"CUDA_VISIBLE_DEVICES": ""}).check()
    return {p.stem: torch.load(p) for p in Path(out).glob("*.pt")}


@pytest.mark.parametrize("skip", [0, 2, 3])
def test_a_unit_skipped_on_one_rank_trains_like_ddp(runs: dict[str, dict], skip: int) -> None:
    ref, got = runs[f"skip{skip}_ddp"]["losses"], runs[f"skip{skip}_zero3"]["losses"]
    assert len(ref) == len(got) == 6
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("skip", [2, 3])
def test_a_unit_skipped_on_one_rank_in_the_first_step_is_an_error_on_every_rank(runs: dict[str, dict],
                                                                                skip: int) -> None:
    """Stage 3 has no recorded order in the first step: instead of hanging, both ranks raise one error that
    names the module each rank entered (first_step.py [Note: units skipped in the first step])."""
    for rank in (0, 1):
        error = runs[f"first{skip}_rank{rank}"]["error"]
        assert "in the first training step the ranks entered different modules" in error
        # rank 1 skipped blocks.{skip}: its next gather is the next block's forward, or after the last block
        # backward's first (blocks.2), while rank 0 is in blocks.{skip}'s forward
        other = "backward" if skip == 3 and rank == 1 else "forward"
        assert f"rank 0 `blocks.{skip}`; rank 1 `blocks.{skip + 1 if skip < 3 else 2}`; this rank in its {other}" in error
        # the first step stopped: in the rank's forward (no loss yet) or its backward (one loss)
        assert len(runs[f"first{skip}_rank{rank}"]["losses"]) == (1 if other == "backward" else 0)


@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3", "zero3_offload", "zero3_offload_skip"])
@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_parameters_unused_on_every_rank_are_not_stepped(runs: dict[str, dict], kind: str, wd: float) -> None:
    """A block and a side layer skipped by every rank on odd steps (and a block on one rank only): AdamW with
    and without weight decay matches ddp(find_unused_parameters=True) at every step, and the skipped layers'
    masters and moments are bit for bit those of before each odd step (3 odd steps of 6)."""
    ref, got = runs[f"odd{wd}_ddp"]["losses"], runs[f"odd{wd}_{kind}"]
    assert len(ref) == len(got["losses"]) == 6
    assert got["losses"] == pytest.approx(ref, rel=1e-4, abs=1e-6)
    assert got["unchanged"] == [True, True, True]
    if kind == "zero3_offload":  # the CPU step ran during backward, piece by piece once counts differ
        assert got["eager_steps"] == 6


@pytest.mark.parametrize("kind", ["zero1", "zero2"])
def test_a_parameter_used_in_one_micro_batch_of_the_window_is_stepped(runs: dict[str, dict], kind: str) -> None:
    ref, got = runs["acc_ddp"]["losses"], runs[f"acc_{kind}"]["losses"]
    assert len(ref) == len(got) == 8
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-6)
