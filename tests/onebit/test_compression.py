"""Single-process checks of the compression pieces: sign packing, layout, the oracle's algebra."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.comm.compressed import (
    ErrorFeedback,
    KernelSignCompressor,
    OneBitLayout,
    TorchDistBackend,
    TorchSignCompressor,
    simulate_onebit_allreduce,
)
from lightning_zero.ops.sign_pack import pack_signs_reference, unpack_signs_reference


@pytest.mark.parametrize(("n", "block"), [(1, 8), (13, 8), (1000, 64), (4099, 1024)])
@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_torch_compressor_matches_the_ops_reference(n: int, block: int, scale: str) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[0] = -0.0
    packed, scales = TorchSignCompressor(scale).compress(x, block)
    ref_packed, ref_scales = pack_signs_reference(x, block, scale)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    out = torch.empty(n)
    TorchSignCompressor(scale).decompress(packed, scales, n, block, out)
    assert torch.equal(out, unpack_signs_reference(packed, scales, n, block))
    k_packed, _ = KernelSignCompressor(scale).compress(x, block)
    assert torch.equal(k_packed, packed)  # same bits from the compiled kernel (or its fallback)


def test_layout_plan() -> None:
    for world in (1, 2, 3, 4, 8):
        for numel in (1, 7, 8, 100, 1023, 4099, 100_003, 1 << 20):
            for block in (8, 16, 1024):
                lay = OneBitLayout.plan(numel, world, block)
                assert lay.block % 8 == 0 and 0 < lay.block <= block
                assert lay.server_numel % lay.block == 0 and lay.server_numel % 8 == 0
                assert lay.padded_numel >= numel
                assert lay.server_numel - -(-numel // world) < 8 * (lay.blocks + 1)  # padding: < 8 per block
                assert lay.payload_bytes == lay.server_numel // 8 + 4 * lay.blocks


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_telescopes(world: int) -> None:
    """sum_t out_t = sum_t mean_t - mean_r(worker_error_r) - server_error, exactly in real numbers.

    So the compression is unbiased over time: whatever one exchange loses is sent later.
    """
    numel, rounds = 1001, 40
    lay = OneBitLayout.plan(numel, world, 64)
    errors = [ErrorFeedback.zeros(lay, torch.device("cpu")) for _ in range(world)]
    compressor = TorchSignCompressor()
    g = torch.Generator().manual_seed(0)
    sum_out = torch.zeros(numel, dtype=torch.float64)
    sum_mean = torch.zeros(numel, dtype=torch.float64)
    base = torch.randn(numel, generator=g)
    for _ in range(rounds):
        xs = [base + 0.3 * torch.randn(numel, generator=g) for _ in range(world)]
        out = simulate_onebit_allreduce(xs, errors, compressor)
        assert all(torch.equal(o, out[0]) for o in out)
        sum_out += out[0].double()
        sum_mean += torch.stack(xs).double().mean(0)
    worker = torch.stack([e.worker.double() for e in errors]).mean(0)[:numel]
    server = torch.cat([e.server.double() for e in errors])[:numel]
    residual = sum_out - (sum_mean - worker - server)
    assert residual.abs().max() < 1e-3 * sum_mean.abs().max()
    # the errors stay bounded, so the relative error of the running sum shrinks like 1/rounds
    assert (sum_out - sum_mean).norm() < 0.15 * sum_mean.norm()


def test_backend_on_one_process_is_the_identity() -> None:
    backend = TorchDistBackend(None)
    assert backend.world_size == 1
    x = torch.randn(100)
    y = x.clone()
    backend.compressed_average_(y, backend.new_errors(100, torch.device("cpu")))
    assert torch.equal(x, y) and backend.counters.bytes_sent == 0
    assert backend.gather_to_root(x)[0].equal(x)
