"""Block quantization (lightning_zero/quant/blocks.py, issue #33) against an element-by-element reference."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.quant import dequantize, quantize


def _reference(x: torch.Tensor, bits: int, block: int) -> tuple[list[int], list[float]]:
    """Codes and scales computed one block and one element at a time, in Python floats."""
    q_max = {8: 127, 4: 7}[bits]
    flat = x.reshape(-1).float().tolist()
    flat += [0.0] * ((-len(flat)) % block)
    codes, scales = [], []
    for b in range(0, len(flat), block):
        chunk = flat[b:b + block]
        s = float(torch.tensor(max(abs(v) for v in chunk), dtype=torch.float32) / q_max)
        scales.append(s)
        for v in chunk:
            c = 0 if s == 0 else int(torch.round(torch.tensor(v, dtype=torch.float32) / torch.tensor(s)))
            codes.append(max(-q_max, min(q_max, c)))
    return codes, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(64, 16), (70, 16), (7, 8)])
def test_codes_and_scales_equal_the_reference(bits: int, numel: int, block: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    x[:block] = 0.0  # a block of zeros stays zero
    qb = quantize(x, bits=bits, block=block)
    codes, scales = _reference(x, bits, block)
    assert torch.equal(qb.scales, torch.tensor(scales, dtype=torch.float32))
    got = qb.codes if bits == 8 else torch.stack([(qb.codes & 0xF), (qb.codes >> 4)], 1).view(-1).to(torch.int16)
    want = torch.tensor(codes, dtype=torch.int16)
    if bits == 4:
        want = want & 0xF  # two's-complement nibbles
    assert torch.equal(got.to(torch.int16), want)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_within_half_a_step(bits: int, dtype: torch.dtype) -> None:
    x = (torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    qb = quantize(x, bits=bits, block=32)
    y = dequantize(qb)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - x.float()).abs().view(-1)
    steps = qb.scales.repeat_interleave(32)[: x.numel()]
    slack = 0.0 if dtype == torch.float32 else 2 ** -7 * x.float().abs().view(-1)  # bf16 rounding of the result
    assert bool((err <= steps / 2 + 1e-6 + slack).all())
    assert torch.equal(dequantize(quantize(torch.zeros(10), bits=bits, block=4)), torch.zeros(10))


def test_wire_bytes() -> None:
    x = torch.randn(4096)
    assert quantize(x, bits=8, block=2048).nbytes == 4096 + 2 * 4
    assert quantize(x, bits=4, block=2048).nbytes == 2048 + 2 * 4


@pytest.mark.parametrize("bad", [dict(bits=3), dict(block=7), dict(block=0)])
def test_bad_arguments(bad: dict) -> None:
    with pytest.raises(ValueError):
        quantize(torch.randn(8), **bad)
