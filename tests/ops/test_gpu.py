"""GPU tests of the CUDA ops and their Triton fallback (run on the lent GPU machine).

    python -m pytest tests/ops -m gpu -q

They JIT-build the CUDA ops for the visible GPU (or TORCH_CUDA_ARCH_LIST) on
first use, then compare every variant to the float64 references.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.ops import OpFallbackWarning, pack_signs, registry, unpack_signs
from lightning_zero.ops.fused_adam import FusedAdamBuilder
from lightning_zero.ops.sign_pack import pack_signs_reference, unpack_signs_reference
from lightning_zero.optim import CPUAdam, FusedAdam, FusedLamb
from lightning_zero.optim.reference import adam_step_reference, lamb_step_reference
from lightning_zero.optim.triton_adam import triton_adam_step, triton_available
from tests.ops.conftest import assert_fp32_close, compiled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# Odd sizes, one element, one larger than a 16K chunk, and > 36 tensors so batching splits.
SIZES = [1, 3, 17, 1000, 16384 + 5, 70_001] + [64] * 40
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
LAMB = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01, bias_correction=True)


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    params = [torch.randn(n, generator=gen, device=DEV).to(dtype) for n in SIZES]
    # A view one element into a buffer: not 16-byte aligned, exercises the scalar path.
    params.append(torch.randn(1001, generator=gen, device=DEV).to(dtype)[1:])
    return params


def _refs(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [[p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)] for p in params]


@pytest.fixture(scope="module")
def fused_adam_op():
    return compiled("fused_adam")


@pytest.fixture(scope="module")
def fused_lamb_op():
    return compiled("fused_lamb")


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=["no_out", "out_bf16", "out_f16"])
def test_fused_adam_matches_float64_reference(fused_adam_op, adamw_mode, grad_dtype, out_dtype) -> None:
    params = _params(0)
    refs = _refs(params)
    opt = FusedAdam(params, lr=ADAM["lr"], weight_decay=ADAM["weight_decay"], adamw_mode=adamw_mode)
    outs = None if out_dtype is None else [torch.empty_like(p, dtype=out_dtype) for p in params]
    gen = torch.Generator(device=DEV).manual_seed(1)
    steps = 30
    for step in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=gen, device=DEV).to(grad_dtype) for p in params]
        opt.step(grads=grads, out16=outs)
        for r, g in zip(refs, grads):
            adam_step_reference(r[0], g.double(), r[1], r[2], step=step, adamw_mode=adamw_mode, **ADAM)
    for i, (p, r) in enumerate(zip(params, refs)):
        assert_fp32_close(p, r[0], steps, f"param {i}")
        assert_fp32_close(opt.state[p]["exp_avg_sq"], r[2], steps, f"exp_avg_sq {i}")
        assert opt.state[p]["step"].item() == steps and opt.state[p]["step"].device.type == "cuda"
        if outs is not None:
            assert torch.equal(outs[i].view(torch.int16), p.to(out_dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_adam_16bit_params(fused_adam_op, dtype) -> None:
    params = _params(2, dtype)
    ref_opt_params = [p.float().clone() for p in params]
    opt = FusedAdam(params, lr=1e-3)
    ref = torch.optim.AdamW(ref_opt_params, lr=1e-3, foreach=False)
    gen = torch.Generator(device=DEV).manual_seed(3)
    for _ in range(5):
        for p, q in zip(params, ref_opt_params):
            q.grad = torch.randn(p.shape, generator=gen, device=DEV).to(dtype).float()
            p.grad = q.grad.to(dtype)
        opt.step()
        ref.step()
        for p, q in zip(params, ref_opt_params):
            q.data.copy_(q.to(dtype).float())  # both keep params in 16 bits
    for p, q in zip(params, ref_opt_params):
        torch.testing.assert_close(p.float(), q, rtol=2e-2, atol=1e-2)


def test_found_inf_and_grad_scale_need_no_sync(fused_adam_op) -> None:
    """A step captured in a CUDA graph (no syncs allowed) honours found_inf and grad_scale on replay."""
    params = _params(4)[:6]
    opt = FusedAdam(params, lr=1e-2)
    grads = [torch.randn_like(p) for p in params]
    found_inf, scale = torch.zeros(1, device=DEV), torch.full((1,), 8.0, device=DEV)
    opt.step(grads=grads)  # creates the state outside the capture
    refs = _refs(params)
    for r, p in zip(refs, params):
        r[1].copy_(opt.state[p]["exp_avg"])
        r[2].copy_(opt.state[p]["exp_avg_sq"])
    scaled = [g * 8 for g in grads]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        opt.step(grads=scaled, grad_scale=scale, found_inf=found_inf)
    torch.cuda.current_stream().wait_stream(stream)
    found_inf.fill_(1.0)
    before = [p.clone() for p in params]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert opt.state[params[0]]["step"].item() == 1
    found_inf.fill_(0.0)
    graph.replay()
    torch.cuda.synchronize()
    for r, g in zip(refs, grads):
        adam_step_reference(r[0], g.double(), r[1], r[2], step=2, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, adamw_mode=True)  # fmt: skip
    for p, r in zip(params, refs):
        assert_fp32_close(p, r[0], 2)
    assert opt.state[params[0]]["step"].item() == 2


def test_grad_scaler_integration_matches_torch_fused(fused_adam_op) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(DEV)
    twin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(DEV)
    twin.load_state_dict(model.state_dict())
    # explicit weight decay: torch's AdamW defaults to 1e-2, FusedAdam (like Adam) to 0
    opts = [
        FusedAdam(model.parameters(), lr=1e-3, weight_decay=1e-2),
        torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=1e-2, fused=True),
    ]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10), torch.amp.GradScaler("cuda", init_scale=2.0**10)]
    for it in range(6):
        x = torch.randn(16, 64, device=DEV)
        for net, opt, scaler in zip((model, twin), opts, scalers):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = net(x).float().pow(2).mean() * (float("inf") if it == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert opts[0].state[next(model.parameters())]["step"].item() == 5  # the inf step was skipped
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_fused_lamb_matches_float64_reference(fused_lamb_op, grad_dtype, out_dtype) -> None:
    params = _params(5)
    params[2].zero_()  # zero norm: trust ratio 1
    refs = _refs(params)
    opt = FusedLamb(params, lr=LAMB["lr"], weight_decay=LAMB["weight_decay"])
    outs = None if out_dtype is None else [torch.empty_like(p, dtype=out_dtype) for p in params]
    gen = torch.Generator(device=DEV).manual_seed(6)
    steps = 20
    for step in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=gen, device=DEV).to(grad_dtype) for p in params]
        opt.step(grads=grads, out16=outs)
        for r, g in zip(refs, grads):
            lamb_step_reference(r[0], g.double(), r[1], r[2], step=step, **LAMB)
    for i, (p, r) in enumerate(zip(params, refs)):
        assert_fp32_close(p, r[0], 4 * steps, f"param {i}")  # norms add a reduction's rounding per step
        if outs is not None:
            assert torch.equal(outs[i], p.to(out_dtype))


def test_fused_lamb_found_inf(fused_lamb_op) -> None:
    params = _params(7)[:5]
    opt = FusedLamb(params)
    grads = [torch.randn_like(p) for p in params]
    opt.step(grads=grads)
    before = [p.clone() for p in params]
    opt.step(grads=grads, found_inf=torch.ones(1, device=DEV))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert opt.state[params[0]]["step"].item() == 1


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_fallback_matches_reference(grad_dtype) -> None:
    params = _params(8)
    refs = _refs(params)
    states = [[torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device=DEV)] for p in params]
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    gen = torch.Generator(device=DEV).manual_seed(9)
    for step in range(1, 21):
        grads = [torch.randn(p.shape, generator=gen, device=DEV).to(grad_dtype) for p in params]
        triton_adam_step(params, grads, [s[0] for s in states], [s[1] for s in states], [s[2] for s in states], outs,
                         adamw_mode=False, found_inf=torch.zeros(1, device=DEV), **ADAM)  # fmt: skip
        for r, g in zip(refs, grads):
            adam_step_reference(r[0], g.double(), r[1], r[2], step=step, adamw_mode=False, **ADAM)
    for p, r, out in zip(params, refs, outs):
        assert_fp32_close(p, r[0], 4 * 20)  # Triton's sqrt/div are approximate (2 ulp)
        assert torch.equal(out, p.bfloat16())


def test_fused_adam_without_compiler_falls_back_and_warns_once(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setenv("LIGHTNING_ZERO_BUILD_DIR", str(tmp_path))
    monkeypatch.setitem(registry.OPS, "fused_adam", FusedAdamBuilder())
    params = _params(10)[:8]
    refs = _refs(params)
    opt = FusedAdam(params, lr=1e-2)
    with pytest.warns(OpFallbackWarning, match="fused_adam") as record:
        for step in range(1, 6):
            grads = [torch.randn_like(p) for p in params]
            opt.step(grads=grads)
            for r, g in zip(refs, grads):
                adam_step_reference(r[0], g.double(), r[1], r[2], step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                                    eps=1e-8, weight_decay=0.0, adamw_mode=True)  # fmt: skip
    assert sum(issubclass(w.category, OpFallbackWarning) for w in record) == 1
    for p, r in zip(params, refs):
        assert_fp32_close(p, r[0], 4 * 5)


@pytest.mark.parametrize(("n", "chunk"), [(1, 8), (1001, 16), (1 << 20, 1 << 18), (300_007, 16_392), (5_000_000, 2_500_000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_sign_pack_cuda_matches_reference(n, chunk, dtype, scale) -> None:
    compiled("sign_pack_cuda")
    x = torch.randn(n + 1, device=DEV).to(dtype)[1:]  # misaligned on purpose
    packed, scales = pack_signs(x, chunk, scale)
    ref_packed, ref_scales = pack_signs_reference(x, chunk, scale)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=2e-5, atol=0)
    out = unpack_signs(packed, scales, n, chunk, dtype=dtype)
    assert torch.equal(out, unpack_signs_reference(packed, scales, n, chunk, dtype))


def test_cpu_adam_writes_pinned_copy_for_upload() -> None:
    compiled("cpu_adam")
    p = torch.randn(10_000)
    out = torch.empty(10_000, dtype=torch.bfloat16).pin_memory()
    opt = CPUAdam([p])
    opt.step(grads=[torch.randn(10_000).bfloat16()], out16=[out])
    gpu = out.to(DEV, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), p.bfloat16())
