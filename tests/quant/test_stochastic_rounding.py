"""Stochastic rounding of qgZ's gradient codes (quant/blocks.py [Note: stochastic rounding of codes]): the hash
against a pure-Python reference, the codes' unbiasedness where rounding to nearest is biased, determinism per
seed, the collective's seed plumbing, and the config's refusals. The fused kernel's equality with this
reference is checked in tests/quant/test_triton_blocks.py (GPU, or Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.comm import quantized
from lightning_zero.config import ZeroConfig
from lightning_zero.config.quantization import QuantCommConfig
from lightning_zero.quant.blocks import dequantize, quantize, seed_key, uniform_from_hash
from lightning_zero.zero.zeropp import rounding_seed

M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_hash_equals_python_integers() -> None:
    index = torch.tensor([0, 1, 2, 3, 2**31, M32, 2**32, 2**40 + 5, 123_456_789, 2**62 + 77])
    for seed in (0, 1, 2**31 - 1, 987_654):
        key = _lowbias32(seed) & 0x7FFFFFFF
        want = [(_lowbias32((int(i) & M32) ^ key) >> 8) / 2**24 for i in index]
        assert seed_key(seed) == key
        assert torch.equal(uniform_from_hash(seed, index), torch.tensor(want, dtype=torch.float32))
    u = uniform_from_hash(7, torch.arange(1 << 18))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 5e-3 and abs(float(u.var()) - 1 / 12) < 2e-3


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_are_floor_or_ceil_and_unbiased(bits: int) -> None:
    """Each dequantized value is one of the two codes around the input, and over many seeds (fixed: the draws
    are a hash, not a generator) their mean is the input: the error of the mean is within 4.5 standard errors
    for every element, and the total bias of the block is tiny, where rounding to nearest zeroes every element
    below half a step (the int4 block: one large value, the rest 1/40 of a step to 0.45 of one)."""
    q_max = 127 if bits == 8 else 7
    step = 1.0 / q_max
    x = torch.cat([torch.ones(1), torch.linspace(step / 40, 0.45 * step, 255) * torch.tensor([1.0, -1.0]).repeat(128)[:255]])
    lo, hi = torch.floor(x / step) * step, torch.ceil(x / step) * step
    n = 3000
    draws = torch.stack([dequantize(quantize(x, bits, 256, seed=s)) for s in range(n)])
    assert bool(((draws - lo).abs() < 1e-6).logical_or((draws - hi).abs() < 1e-6).all())
    mean, stderr = draws.mean(0), draws.std(0) / n**0.5
    moving = stderr > 0
    assert bool(((mean - x).abs()[moving] <= 4.5 * stderr[moving] + 1e-7).all())
    nearest = dequantize(quantize(x, bits, 256))
    small = x.abs() < step / 2
    assert bool((nearest[small] == 0).all())  # rounding to nearest drops them all
    assert float((mean[small] - x[small]).abs().sum()) < 0.05 * float(x[small].abs().sum())


def test_same_seed_same_codes_other_seed_other_codes() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    a, b, c = (quantize(x, 4, 2048, seed=s) for s in (11, 11, 12))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, c.scales)
    assert not torch.equal(a.codes, c.codes)
    assert torch.equal(quantize(x, 4, 2048).scales, a.scales)  # the scales do not depend on rounding


def test_reduce_scatter_rounds_from_its_seed() -> None:
    """One process: the collective's result is the dequantized stochastic codes (seed given) or the nearest
    ones (none), so the seed reaches the quantizer."""
    x = torch.randn(3 * 1000, generator=torch.Generator().manual_seed(1))
    got, _ = quantized.reduce_scatter(x, None, bits=4, block=256, seed=5)
    assert torch.equal(got, dequantize(quantize(x, 4, 256, seed=5)))
    assert not torch.equal(got, quantized.reduce_scatter(x, None, bits=4, block=256)[0])


def test_seeds_differ_by_reduction_rank_and_level() -> None:
    seeds = {rounding_seed(r, k, lv) for r in range(200) for k in range(8) for lv in (0, 1)}
    assert len(seeds) == 200 * 8 * 2 and all(0 <= s < 2**31 for s in seeds)


def test_bad_seed_refused() -> None:
    with pytest.raises(ValueError, match="seed must be in"):
        quantize(torch.ones(4), 4, 2, seed=2**31)


def test_config_refuses_stochastic_without_qgz_and_unknown_modes() -> None:
    with pytest.raises(ValueError, match="needs quantized_gradients"):
        ZeroConfig(stage=3, gradient_rounding="stochastic")
    with pytest.raises(ValueError, match="gradient_rounding must be one of"):
        QuantCommConfig(quantized_gradients="int4", gradient_rounding="up")
    cfg = ZeroConfig(stage=3, quantized_gradients="int4", gradient_rounding=" Stochastic")  # Hydra's string
    assert cfg.piece(QuantCommConfig).gradient_rounding == "stochastic"
