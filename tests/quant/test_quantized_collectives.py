"""ZeRO++'s quantized all-gather (qwZ) and reduce-scatter (qgZ) on 2 and 4 gloo ranks against the exact
collectives: every element within the bound the format guarantees, and the bytes each rank sends."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_scenario


@pytest.fixture(scope="module", params=[2, 4], ids=["two_ranks", "four_ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run = run_scenario("quant.collectives", nprocs=request.param, out=tmp_path_factory.mktemp("qcoll"),
                       timeout=300).check()
    return run.ranks("result")


@pytest.mark.parametrize("bits", [8, 4])
def test_within_half_a_step_and_fewer_bytes(results: list[dict], bits: int) -> None:
    for rank in results:
        rec = rank[bits]
        assert rec["ag_err"] <= rec["ag_bound"] + 1e-6  # each gathered value within half its block's step
        assert rec["rs_ok"], rec["rs_err"]  # the sum within the half-steps of the N contributions
        assert rec["ag_err"] > 0 and rec["rs_err"] > 0  # quantization did happen
        ratio = {8: 0.6, 4: 0.35}[bits]  # against bf16 on the wire (block 32: one fp32 scale per 32 codes)
        assert rec["ag_sent"] <= ratio * rec["exact_ag_bytes"]
        assert rec["rs_sent"] <= ratio * rec["exact_rs_bytes"]


@pytest.mark.parametrize("results", [4], indirect=True, ids=["four_ranks"])
def test_hierarchical_reduce_scatter_within_both_levels(results: list[dict]) -> None:
    """Four ranks as two nodes of two: hpZ's two-level qgZ, every element within the half-steps of both
    levels (each dequantized and summed in fp32, so the bound adds up, it does not multiply); the bytes
    sent across nodes are half of a one-level reduce-scatter's."""
    for rank in results:
        rec = rank["hier"]
        assert rec["ok"] and rec["err"] > 0, rec
        intra, cross = rec["levels"]
        assert intra > 0 and cross > 0
        assert cross <= 0.5 * rec["flat_bytes"] + 64, rec  # 1 of 3 chunks leaves the node instead of 3 of 4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [7, 500, 512], ids=lambda n: f"numel{n}")
def test_one_process_round_trip_any_size(bits: int, numel: int) -> None:
    """Without a process group every collective is a copy of this rank's quantized pieces: any size (odd
    code counts, a partial last block, a whole number of blocks), within half a step of the input."""
    import torch

    from lightning_zero.comm import quantized

    x = torch.randn(3 * numel, generator=torch.Generator().manual_seed(numel))
    half = x.abs().max() / {8: 127, 4: 7}[bits] / 2
    gathered, sent = quantized.all_gather(x, None, bits=bits, block=256)
    reduced, _ = quantized.reduce_scatter(x, None, bits=bits, block=256)
    two = quantized.start_reduce_scatter_hierarchical(x, None, None, bits=bits, block=256)
    two.wait()
    for got in (gathered, reduced, two.result):
        assert got.shape == x.shape and float((got - x).abs().max()) <= half + 1e-6
    assert sent == 0  # nothing leaves a world of one
