"""OneBitAdam / OneBitLamb through ZeroStrategy(stage=0) on 2 gloo ranks: convergence, bytes, resume.

One launch of scenario ``onebit.train`` runs every case of train_runs.py (the example GPT, 2 layers x 64 wide, on the
byte-level pydoc corpus); the tests only read its results.
"""

from __future__ import annotations

import pytest

from lightning_zero.comm import collectives as C
from tests.helpers.harness import run_scenario


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = run_scenario("onebit.train", nprocs=2, params={"cases": ["converge", "resume"]}, timeout=900,
                       out=tmp_path_factory.mktemp("onebit_train"), env={"CUDA_VISIBLE_DEVICES": ""})
    return run.check().rank0("result")


def _final(run: dict) -> float:
    return run["val_loss"]


@pytest.mark.parametrize(("onebit", "baseline"), [("onebit_adam", "adam"), ("onebit_lamb", "lamb")])
def test_converges_like_the_exact_optimizer(runs: dict, onebit: str, baseline: str) -> None:
    """300 steps, 15% warm-up: validation loss within 3% of AdamW (zero0) / LAMB (FusedLamb, ddp)."""
    got, ref = runs["converge"][onebit], runs["converge"][baseline]
    assert len(got["losses"]) == len(ref["losses"]) >= 300
    assert got["freeze_step"] == 45
    assert ref["val_loss"] < 0.75 * ref["losses"][0]  # the baseline really learned something
    # not worse by more than 3% (and not so much better that the baseline must be broken)
    assert 0.9 * _final(ref) <= _final(got) <= 1.03 * _final(ref), (onebit, _final(got), baseline, _final(ref))
    # identical warm-up data and math: the first steps agree closely with the exact optimizer
    for a, b in zip(got["losses"][:20], ref["losses"][:20]):
        assert abs(a - b) <= 1e-3 * abs(b)


@pytest.mark.parametrize("kind", ["onebit_adam", "onebit_lamb"])
def test_compression_phase_bytes_per_step(runs: dict, kind: str) -> None:
    """Everything handed to torch.distributed in one whole compressed training step, counted by
    wrapping its collectives, against a 16-bit all-reduce of the same momentum counted alike (both
    as per-rank wire bytes; see tests/onebit/test_allreduce.py for why)."""
    run = runs["converge"][kind]
    freeze = run["freeze_step"]
    warm, comp = run["counted"][freeze - 1], run["counted"][freeze + 5]
    assert comp["wire"] <= comp["plain_wire"] / 12, comp
    names = [name for name, _ in comp["calls"]]
    # per param group one all-to-all + one all-gather; the all-reduces are the 4-byte grad norm and the
    # used-parameter mask (one byte per parameter: zero/unused.py)
    assert names.count("all_to_all_single") == names.count(C.ALL_GATHER_FN) == 2
    assert [n for name, n in comp["calls"] if name == "all_reduce"] == [4, run["n_params"]]
    # in warm-up the engine all-reduces the (fp32 here) gradients in full
    assert sum(n for name, n in warm["calls"] if name == "all_reduce") >= 4 * warm["momentum_numel"]


@pytest.mark.parametrize("kind", ["onebit_adam", "onebit_lamb"])
def test_total_volume_and_reported_stats(runs: dict, kind: str) -> None:
    run = runs["converge"][kind]
    stats = run["stats"]
    freeze = run["freeze_step"]
    assert [s["onebit/phase"] for s in stats[:freeze]] == [0.0] * freeze
    assert all(s["onebit/phase"] == 1.0 for s in stats[freeze:])
    last = stats[-1]
    # over the run with 15% warm-up (16-bit warm-up accounting): >= 4.5x less than 16-bit all-reduces
    assert last["onebit/compression_ratio"] >= 4.5
    counted = run["counted"][freeze + 5]
    reduced = sum(n for name, n in counted["calls"] if name == "all_reduce")  # the norm and the used mask
    assert stats[freeze + 4]["onebit/bytes_sent"] == pytest.approx(counted["wire"] - reduced, rel=1e-6)


@pytest.mark.parametrize("kind", ["onebit_adam", "onebit_lamb"])
def test_resume_mid_compression_continues_bit_for_bit(runs: dict, kind: str) -> None:
    run = runs["resume"][kind]
    assert len(run["resumed"]) == 10
    assert run["resumed"] == run["losses"][-10:]
    comm = run["comm_state"]
    assert comm["world_size"] == 2 and set(comm["errors"]) == {0, 1}  # every rank's error buffers
    assert not all(w.equal(comm["errors"][1][i][0]) for i, (w, _) in comm["errors"][0].items())  # per rank
