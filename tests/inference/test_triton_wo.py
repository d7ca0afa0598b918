"""The Triton weight-only int8/int4 kernel (lightning_zero/inference/triton_wo.py) against dequantize-then-matmul.

On CPU (CI, no Triton): the seam's built-in kernel declines and QuantLinear is the reference exactly, also
when Triton is reported missing, off CUDA, past 16 rows, for group sizes and dtypes the kernel does not take.
Where Triton is installed, the kernel runs in its interpreter (``TRITON_INTERPRET=1``, in a subprocess: the
variable is read when Triton is imported) on fp32 and fp16 inputs (the interpreter mishandles bf16
conversions). On a GPU (marked ``gpu``: ``python -m pytest tests/inference -m gpu``): int8 and int4 at
Llama-like and odd shapes, 1 to 16 rows, bf16/fp16/fp32, with and without bias, inside ``torch.compile``
without a graph break, and a quantized Llama's compiled greedy decode equal to its uncompiled one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.inference import quant, triton_wo
from lightning_zero.inference.quant import QuantLinear
from lightning_zero.inference.triton_wo import triton_available, triton_weight_only
from tests.helpers.launch import ROOT

CASES = [  # (in_features, out_features, group, rows, bias)
    (256, 48, 128, 1, True), (200, 40, 64, 3, False), (96, 33, 32, 16, True), (384, 130, 128, 5, True)]


@torch.no_grad()
def compare(device: str, dtypes: tuple[torch.dtype, ...], kernel: str = "triton_weight_only") -> list[str]:
    """Cases where the kernel's output is farther from dequantize-then-matmul (computed in fp64) than the
    rounding of a matmul in that dtype allows; empty when every case agrees. ``kernel``: ``triton_weight_only``
    or ``triton_gemv`` (inference/triton_gemv.py: the one-row cases, every row count cut to one)."""
    if kernel == "triton_gemv":
        from lightning_zero.inference.triton_gemv import triton_gemv as run
    else:
        run = triton_weight_only
    bad = []
    for bits in (8, 4):
        for k, n, group, rows, bias in CASES:
            rows = 1 if kernel == "triton_gemv" else rows
            torch.manual_seed(k + n + bits)
            q = QuantLinear.from_linear(nn.Linear(k, n, bias=bias), bits=bits, group_size=group).to(device)
            for dtype in dtypes:
                x = torch.randn(rows, k, device=device).to(dtype)
                got = run(x, q)
                if got is None:
                    bad.append(f"int{bits} {k}x{n} g{group} rows {rows} {dtype}: the kernel declined")
                    continue
                w = q.dequantized_weight(torch.float64)
                want = F.linear(x.double(), w, q.bias.double() if q.bias is not None else None)
                eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
                tol = 4 * eps * (x.double().abs() @ w.abs().T) + 2 * eps * want.abs()  # accumulation + output rounding
                err = (got.double() - want).abs()
                if got.dtype != dtype or got.shape != (rows, n) or bool((err > tol + 1e-6).any()):
                    bad.append(f"int{bits} {k}x{n} g{group} rows {rows} {dtype}: max error {float(err.max()):.3g}")
    return bad


def test_seam_uses_the_reference_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_zero.inference.triton_gemv import triton_gemv

    assert quant._KERNELS[:2] == [triton_gemv, triton_weight_only]  # built in, first: one row, then up to 16
    q = QuantLinear.from_linear(nn.Linear(256, 24), bits=4, group_size=128)
    x = torch.randn(2, 256)
    reference = F.linear(x, q.dequantized_weight(), q.bias)
    if not triton_wo._INTERPRET:
        assert triton_weight_only(x, q) is None  # off CUDA (without the interpreter): declined
    monkeypatch.setattr(triton_wo, "triton_available", lambda: False)  # the CPU wheel: no Triton
    assert triton_weight_only(x, q) is None
    assert triton_gemv(x[:1], q) is None
    assert torch.equal(q(x), reference)


@pytest.mark.parametrize("case", ["rows", "group", "dtype", "grad"])
def test_kernel_declines_what_it_does_not_take(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_wo, "triton_available", lambda: True)  # as if Triton and CUDA were there
    monkeypatch.setattr(triton_wo, "_INTERPRET", True)
    group = 8 if case == "group" else 32
    q = QuantLinear.from_linear(nn.Linear(64, 8), bits=8, group_size=group)
    rows = 17 if case == "rows" else 2
    x = torch.randn(rows, 64, dtype=torch.float64 if case == "dtype" else torch.float32,
                    requires_grad=case == "grad")
    assert triton_weight_only(x, q) is None


@torch.no_grad()
def test_gemv_declines_codes_off_a_word_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV reads codes as 32-bit words: codes that are a view starting off a 4-byte boundary go elsewhere."""
    from lightning_zero.inference.triton_gemv import triton_gemv

    monkeypatch.setattr(triton_wo, "triton_available", lambda: True)  # as if Triton and CUDA were there
    monkeypatch.setattr(triton_wo, "_INTERPRET", True)
    q = QuantLinear.from_linear(nn.Linear(64, 8), bits=8, group_size=32)
    one = torch.randn(1, 64)
    q.codes = torch.cat([torch.zeros(1, dtype=q.codes.dtype), q.codes])[1:]
    assert triton_wo.takes(one, q)  # everything else about the call is one the kernel takes
    assert q.codes.storage_offset() == 1 and triton_gemv(one, q) is None


@torch.no_grad()
def test_gemv_check_traces_without_a_graph_break(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV's refusal check runs inside the compiled decode step (``fullgraph=True``): ``storage_offset()``
    there was a graph break that failed the GPU test and decoded int8 at 14.8 tokens/s (2026-11-28 16:45)."""
    from lightning_zero.inference.triton_gemv import gemv_takes

    monkeypatch.setattr(triton_wo, "triton_available", lambda: True)
    monkeypatch.setattr(triton_wo, "_INTERPRET", True)
    q = QuantLinear.from_linear(nn.Linear(64, 8), bits=8, group_size=32)
    one = torch.randn(1, 64)
    traced = torch.compile(lambda x: x * 2 if gemv_takes(x, q) else x * 3, fullgraph=True, backend="eager")
    assert gemv_takes(one, q) and torch.equal(traced(one), one * 2)
    assert not gemv_takes(torch.randn(2, 64), q)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("kernel", ["triton_weight_only", "triton_gemv"])
def test_kernel_in_the_interpreter(kernel: str) -> None:
    code = ("import torch; from tests.inference.test_triton_wo import compare; "
            f"bad = compare('cpu', (torch.float32, torch.float16), {kernel!r}); print(bad); assert not bad")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


GPU = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU and Triton")


@pytest.mark.gpu
@GPU
@torch.no_grad()
@pytest.mark.parametrize("kernel", ["triton_weight_only", "triton_gemv"])
def test_kernel_on_cuda(kernel: str) -> None:
    from lightning_zero.inference.triton_gemv import triton_gemv

    run = triton_gemv if kernel == "triton_gemv" else triton_weight_only
    assert compare("cuda", (torch.bfloat16, torch.float16, torch.float32), kernel) == []
    for bits in (8, 4):  # Llama-3-8B's shapes, one row (decode)
        for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)):
            q = QuantLinear.from_linear(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), bits, 128)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x.float(), q.dequantized_weight(torch.float32))
            got = run(x, q)
            assert got is not None
            torch.testing.assert_close(got.float(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)
    if kernel == "triton_gemv":  # traced by torch.compile without a graph break, as the decode step needs
        from torch._dynamo.utils import counters

        q = QuantLinear.from_linear(nn.Linear(256, 64, device="cuda", dtype=torch.bfloat16), 4, 128)
        x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
        counters.clear()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(q, fullgraph=True)(x), q(x))
        assert not counters["graph_break"]


@pytest.mark.gpu
@GPU
def test_kernel_inside_compile_and_compiled_decode() -> None:
    from torch._dynamo.utils import counters

    from lightning_zero.inference import generate, quantize_linears
    from tests.inference.predict_runs import build

    q = QuantLinear.from_linear(nn.Linear(256, 64, device="cuda", dtype=torch.bfloat16), 4, 128)
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    counters.clear()
    with torch.no_grad():
        eager = q(x)
        compiled = torch.compile(q, fullgraph=True)(x)
    assert not counters["graph_break"]
    torch.testing.assert_close(compiled, eager)
    for bits in (8, 4):
        model = build("llama").to("cuda")
        quantize_linears(model, bits=bits, group_size=32)
        prompt = torch.randint(0, 48, (2, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        want = generate(model, prompt, 12)  # the kernel, eagerly
        assert torch.equal(generate(model, prompt, 12, compile=True), want)
