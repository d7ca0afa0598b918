"""Weight-only int8/int4 quantization for inference (issue #31; lightning_zero/inference/quant.py): codes and
scales bit for bit against a per-row, per-group reference written element by element, every weight within
half its group's step, zero groups exact, padded rows; QuantLinear equal to dequantize-then-matmul and within
the quantization bound of the fp32 layer; a whole GPT quantized (weight storage counted, outputs close, its
state dict loading into a fresh quantized model); the kernel seam."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.inference.quant import (QuantLinear, dequantize_weight, quantize_linears, quantize_weight,
                                            register_kernel)
from tests.helpers.memory import storage_bytes
from tests.inference.predict_runs import build

Q_MAX = {8: 127, 4: 7}


def reference(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [out, in_padded] (int, unpacked) and scales [out, groups], one group at a time."""
    out, n = w.shape
    padded = n + (-n) % group
    codes = torch.zeros(out, padded, dtype=torch.int64)
    scales = torch.zeros(out, padded // group)
    for r in range(out):
        row = torch.cat([w[r].float(), torch.zeros(padded - n)])
        for gi in range(padded // group):
            chunk = row[gi * group:(gi + 1) * group]
            s = chunk.abs().max() / Q_MAX[bits]
            scales[r, gi] = s
            if s > 0:
                codes[r, gi * group:(gi + 1) * group] = torch.round(chunk / s).clamp(-Q_MAX[bits], Q_MAX[bits]).long()
    return codes, scales


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.long()
    low, high = (codes & 0xF).long(), (codes >> 4).long()
    both = torch.stack([low, high], dim=1).reshape(-1)
    return torch.where(both > 7, both - 16, both)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,group", [((6, 32), 8), ((5, 20), 8), ((3, 64), 64)])
def test_quantize_against_reference(bits: int, shape: tuple[int, int], group: int) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    w[1, :group] = 0.0  # a zero group stays exactly zero
    qb = quantize_weight(w, bits, group)
    codes, scales = reference(w, bits, group)
    assert torch.equal(qb.scales, scales.reshape(-1))
    assert torch.equal(unpack(qb.codes, bits), codes.reshape(-1))
    back = dequantize_weight(qb, shape[1])
    assert back.shape == w.shape and back.dtype == w.dtype
    step = scales.repeat_interleave(group, dim=1)[:, : shape[1]]
    assert ((back - w).abs() <= step / 2 + 1e-7).all()
    assert back[1, :group].eq(0).all()
    bytes_per_weight = (qb.codes.numel() * qb.codes.element_size() + qb.scales.numel() * 4) / w.numel()
    padded = (shape[1] + (-shape[1]) % group) / shape[1]
    assert bytes_per_weight == pytest.approx(padded * (bits / 8 + 4 / group))


@pytest.mark.parametrize("bits", [8, 4])
def test_quant_linear(bits: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    q = QuantLinear.from_linear(linear, bits=bits, group_size=16)
    x = torch.randn(3, 7, 40)
    y = q(x)
    w = q.dequantized_weight()
    assert torch.equal(y, torch.nn.functional.linear(x, w, linear.bias))  # the CPU path is dequantize-then-matmul
    # each output is within sum_i |x_i| * step_i / 2 of the fp32 layer's
    step = q.scales.view(24, -1).repeat_interleave(16, dim=1)[:, :40]
    bound = x.abs() @ (step / 2).T
    assert ((y - linear(x)).abs() <= bound + 1e-5).all()
    assert q.bias is not None and torch.equal(q.bias, linear.bias)


def test_kernel_seam() -> None:
    q = QuantLinear.from_linear(nn.Linear(16, 8), bits=8, group_size=8)
    x = torch.randn(2, 16)
    calls = []
    remove = register_kernel(lambda x, layer: calls.append(layer) or None)  # declines: the reference path runs
    try:
        assert torch.equal(q(x), torch.nn.functional.linear(x, q.dequantized_weight(), q.bias))
    finally:
        remove()
    assert calls == [q]
    remove = register_kernel(lambda x, layer: torch.zeros(2, 8))
    try:
        assert q(x).eq(0).all()
    finally:
        remove()


@pytest.mark.parametrize("bits,max_rel", [(8, 0.02), (4, 0.35)])
def test_quantized_gpt(bits: int, max_rel: float) -> None:
    model = build("gpt")
    x = torch.randint(0, 48, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x)
    linear_bytes = storage_bytes(m.weight for m in model.modules() if type(m) is nn.Linear)
    names = quantize_linears(model, bits=bits, group_size=32)
    assert len(names) == 3 * 4 and all(isinstance(model.get_submodule(n), QuantLinear) for n in names)
    quant_bytes = storage_bytes(t for m in model.modules() if isinstance(m, QuantLinear) for t in (m.codes, m.scales))
    # every in_features divides by 32: per weight, the code and 1/32 of an fp32 scale (0.28x / 0.16x of fp32)
    assert quant_bytes == linear_bytes / 4 * (bits / 8 + 4 / 32)
    with torch.no_grad():
        got = model(x)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < max_rel, rel
    fresh = build("gpt")
    quantize_linears(fresh, bits=bits, group_size=32)
    fresh.load_state_dict(model.state_dict())  # codes and scales travel in the state dict
    with torch.no_grad():
        assert torch.equal(fresh(x), got)


def test_skip_and_refusals() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert quantize_linears(model, group_size=8, skip=["2"]) == ["0"]
    assert type(model[2]) is nn.Linear
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.zeros(4), 8, 8)
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight(torch.zeros(4, 4), 8, 3)
    with pytest.raises(ValueError, match="bits"):
        QuantLinear(8, 8, bits=3)
