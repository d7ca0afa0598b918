"""The one-row fused-reduction weight-only path (lightning_zero/inference/inductor_wo.py) against
dequantize-then-matmul (quant.py's reference), eagerly and compiled by inductor on CPU, and the seam's choice
of it: only while dynamo traces, only for one row, never where autograd needs a backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.inference import inductor_wo, quant
from lightning_zero.inference.inductor_wo import inductor_weight_only, reduction_weight_only
from lightning_zero.inference.quant import QuantLinear

CASES = [  # (in_features, out_features, group, bias)
    (256, 48, 128, True), (200, 40, 64, False), (96, 33, 32, True), (130, 7, 2, False)]


def quantized(k: int, n: int, group: int, bias: bool, bits: int) -> QuantLinear:
    torch.manual_seed(k * 7 + n + bits)
    linear = nn.Linear(k, n, bias=bias)
    if bias:
        nn.init.normal_(linear.bias)
    return QuantLinear.from_linear(linear, bits=bits, group_size=group)


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, q: QuantLinear) -> None:
    """``got`` within the rounding of a matmul in ``x``'s dtype of the exact (fp64) dequantized product."""
    w = q.dequantized_weight(torch.float64)
    want = F.linear(x.double(), w, q.bias.double() if q.bias is not None else None)
    eps = torch.finfo(x.dtype).eps
    tol = 4 * eps * (x.double().abs() @ w.abs().T) + 2 * eps * want.abs() + 1e-6
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g} against tolerance {float(tol.max()):.3g}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduction_matches_dequantize_then_matmul(bits: int, dtype: torch.dtype) -> None:
    for k, n, group, bias in CASES:
        q = quantized(k, n, group, bias, bits)
        for shape in ((1, k), (1, 1, k), (k,)):
            x = torch.randn(shape).to(dtype)
            assert_within_rounding(reduction_weight_only(x, q), x, q)


def test_reference_and_reduction_agree_on_zero_padding() -> None:
    """in_features not a multiple of the group: the padded codes are zero, the padded inputs too."""
    q = quantized(130, 5, 64, True, 4)
    x = torch.randn(1, 130)
    torch.testing.assert_close(reduction_weight_only(x, q), F.linear(x, q.dequantized_weight(), q.bias),
                               rtol=1e-5, atol=1e-5)


def test_seam_takes_it_only_while_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    q = quantized(256, 24, 128, True, 8)
    x = torch.randn(1, 256)
    assert inductor_weight_only(x, q) is None  # eager: the reference (or Triton) runs
    calls: list[int] = []
    real = inductor_wo.reduction_weight_only

    def counted(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, layer)

    monkeypatch.setattr(inductor_wo, "reduction_weight_only", counted)
    with torch.no_grad():
        one = torch.compile(q, backend="eager", fullgraph=True)(x)
        torch._dynamo.reset()
        two = torch.compile(q, backend="eager", fullgraph=True)(torch.randn(2, 256))
    assert calls == [1], "one row traced takes the reduction; two rows do not"
    assert_within_rounding(one, x, q)
    assert two.shape == (2, 24)


def test_seam_declines_rows_grad_and_other_widths() -> None:
    q = quantized(64, 8, 32, True, 8)
    seen = []

    def probe(x: torch.Tensor) -> None:
        seen.append(inductor_weight_only(x, q))

    torch._dynamo.reset()
    torch.compile(probe, backend="eager")(torch.randn(3, 64))
    torch._dynamo.reset()
    torch.compile(probe, backend="eager")(torch.randn(1, 64, requires_grad=True))
    torch._dynamo.reset()
    torch.compile(probe, backend="eager")(torch.randn(1, 32))
    assert seen == [None, None, None]


@pytest.mark.parametrize("bits", [8, 4])
def test_inductor_compiled_layer_equals_reference(bits: int) -> None:
    """The real codegen (inductor's C++ on CPU; Triton on CUDA): a one-row call of a compiled quantized MLP."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(96, 64), nn.SiLU(), nn.Linear(64, 40))
    quant.quantize_linears(model, bits=bits, group_size=32)
    x = torch.randn(1, 96)
    with torch.no_grad():
        reference = model(x)  # eager: dequantize-then-matmul
        compiled = torch.compile(model, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-5)
