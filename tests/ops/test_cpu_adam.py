"""CPU Adam op and CPUAdam optimizer against the float64 reference (csrc/cpu_adam)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from lightning_zero.ops import OpFallbackWarning, registry
from lightning_zero.ops.cpu_adam import CPUAdamBuilder
from lightning_zero.optim import CPUAdam
from lightning_zero.optim.reference import adam_step_reference
from tests.ops.conftest import assert_fp32_close

STEPS = 40
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _run_and_compare(
    n: int, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, adamw_mode: bool, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    ref = [p.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)]
    opt = CPUAdam([p], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], adamw_mode=adamw_mode)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, STEPS + 1):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        opt.step(grads=[grad], out16=None if out is None else [out])
        adam_step_reference(*ref[:1], grad.double(), *ref[1:], step=step, adamw_mode=adamw_mode, **HYPER)
    state = opt.state[p]
    assert state["step"].item() == STEPS
    assert_fp32_close(p, ref[0], STEPS, "params")
    assert_fp32_close(state["exp_avg"], ref[1], STEPS, "exp_avg")
    assert_fp32_close(state["exp_avg_sq"], ref[2], STEPS, "exp_avg_sq")
    if out is not None:
        assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16)), "16-bit copy != p.to(dtype)"


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=["no_out", "out_bf16", "out_f16"])
def test_every_variant_matches_float64_reference(
    cpu_adam_op: ModuleType, adamw_mode: bool, grad_dtype: torch.dtype, out_dtype: torch.dtype | None
) -> None:
    _run_and_compare(1037, grad_dtype, out_dtype, adamw_mode)


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 33, 100_003])
def test_odd_lengths(cpu_adam_op: ModuleType, n: int) -> None:
    _run_and_compare(n, torch.bfloat16, torch.bfloat16, adamw_mode=True, seed=n)


def test_torch_fp32_adam_is_within_the_same_bound() -> None:
    """The tolerance is fair: torch's own fp32 AdamW meets it against the same reference."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(1037, generator=gen)
    p64, m64, v64 = p.double(), torch.zeros(1037, dtype=torch.float64), torch.zeros(1037, dtype=torch.float64)
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    for step in range(1, STEPS + 1):
        p.grad = torch.randn(1037, generator=gen)
        opt.step()
        adam_step_reference(p64, p.grad.double(), m64, v64, step=step, adamw_mode=True, **HYPER)
    assert_fp32_close(p, p64, STEPS, "torch AdamW")


@pytest.mark.parametrize("tier", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_every_simd_tier_matches_reference(cpu_adam_op: ModuleType, tier: int) -> None:
    if tier > cpu_adam_op.best_simd():
        pytest.skip(f"CPU lacks SIMD tier {tier}")
    gen = torch.Generator().manual_seed(tier)
    n = 4099
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    ref = [p.double(), m.double(), v.double()]
    out = torch.empty(n, dtype=torch.float16)
    for step in range(1, 21):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        used = cpu_adam_op.adam_step(
            p, grad, m, v, out, step=step, adamw_mode=False, simd_tier=tier, num_threads=2,
            **{k: HYPER[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")},
        )  # fmt: skip
        assert used == tier
        adam_step_reference(ref[0], grad.double(), ref[1], ref[2], step=step, adamw_mode=False, **HYPER)
    assert_fp32_close(p, ref[0], 20, f"tier {tier}")
    assert torch.equal(out.view(torch.int16), p.half().view(torch.int16))


@pytest.mark.parametrize("tier", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_out_rounds_like_torch_on_special_values(cpu_adam_op: ModuleType, tier: int, dtype: torch.dtype) -> None:
    """lr=0 and zero grads leave params unchanged, so the copy must equal torch's cast bit for bit."""
    if tier > cpu_adam_op.best_simd():
        pytest.skip(f"CPU lacks SIMD tier {tier}")
    tiny = torch.finfo(torch.float16).tiny
    specials = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, tiny, tiny / 3, 1e-8, 6e-8, 3e-8,
         1 + 2**-8, 1 + 3 * 2**-9, 3.3895e38, float("inf"), float("-inf"), 1.00390625, 1.01171875]
    )  # fmt: skip
    p = torch.cat([specials, torch.randn(1000) * 1e3, torch.randn(1000) * 1e-6])
    expected = p.to(dtype)
    out = torch.empty_like(p, dtype=dtype)
    zeros = torch.zeros_like(p)
    cpu_adam_op.adam_step(
        p, zeros, zeros.clone(), zeros.clone(), out, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, adamw_mode=True, step=1, simd_tier=tier,
    )  # fmt: skip
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    nan_out = torch.empty(3, dtype=dtype)
    nan_p = torch.tensor([float("nan"), 1.0, 2.0])
    z3 = torch.zeros(3)
    cpu_adam_op.adam_step(
        nan_p, z3, z3.clone(), z3.clone(), nan_out, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, adamw_mode=True, step=1, simd_tier=tier,
    )  # fmt: skip
    assert nan_out[0].isnan() and nan_out[1:].tolist() == [1.0, 2.0]


def test_several_param_groups_and_grad_paths(cpu_adam_op: ModuleType) -> None:
    """Groups with their own hyper-parameters; .grad and grads= both work; missing grads are skipped."""
    gen = torch.Generator().manual_seed(3)
    a, b, c = torch.randn(5, 3, generator=gen), torch.randn(1, generator=gen), torch.randn(64, generator=gen)
    opt = CPUAdam([{"params": [a, b], "lr": 1e-2}, {"params": [c], "lr": 3e-3, "weight_decay": 0.5}], weight_decay=0.0)
    refs = {id(t): [t.double(), torch.zeros_like(t, dtype=torch.float64), torch.zeros_like(t, dtype=torch.float64)] for t in (a, b, c)}
    for step in range(1, 11):
        grads = [torch.randn(t.shape, generator=gen) for t in (a, b, c)]
        a.grad = grads[0]
        opt.step(grads=[None, grads[1].to(torch.float16), grads[2].to(torch.bfloat16)])
        for t, g, lr, wd in ((a, grads[0], 1e-2, 0.0), (b, grads[1].half(), 1e-2, 0.0), (c, grads[2].bfloat16(), 3e-3, 0.5)):
            r = refs[id(t)]
            adam_step_reference(r[0], g.double(), r[1], r[2], step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=wd, adamw_mode=True)  # fmt: skip
    for t in (a, b, c):
        assert_fp32_close(t, refs[id(t)][0], 10, "param group")
    a.grad = None
    before = a.clone()
    opt.step(grads=[None, None, None])
    assert torch.equal(a, before) and opt.state[a]["step"].item() == 10


def test_state_dict_round_trips_with_torch_adamw(cpu_adam_op: ModuleType) -> None:
    gen = torch.Generator().manual_seed(4)
    p = torch.randn(300, generator=gen)
    q = p.clone()
    ours = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        p.grad = torch.randn(300, generator=gen)
        q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    sd = ours.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["param_groups"][0]["decoupled_weight_decay"] is True
    swapped_theirs = torch.optim.AdamW([p.clone()], lr=1e-2, weight_decay=0.1)
    swapped_theirs.load_state_dict(sd)
    swapped_ours = CPUAdam([q.clone()], lr=1e-2)
    swapped_ours.load_state_dict(theirs.state_dict())
    assert swapped_ours.param_groups[0]["weight_decay"] == 0.1
    torch.testing.assert_close(swapped_ours.state[swapped_ours.param_groups[0]["params"][0]]["exp_avg"], theirs.state[q]["exp_avg"])


def test_rejects_non_fp32_or_non_cpu_params() -> None:
    with pytest.raises(ValueError, match="float32 CPU"):
        CPUAdam([torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="grads"):
        CPUAdam([torch.zeros(3)]).step(grads=[])


def test_fallback_without_compiler_matches_and_warns_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """With the compiler hidden and an empty cache, CPUAdam runs torch's fused op and says so once."""
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setenv("LIGHTNING_ZERO_BUILD_DIR", str(tmp_path))
    monkeypatch.setitem(registry.OPS, "cpu_adam", CPUAdamBuilder())  # a fresh, unloaded cache
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(257, generator=gen)
    p64, m64, v64 = p.double(), torch.zeros(257, dtype=torch.float64), torch.zeros(257, dtype=torch.float64)
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1, adamw_mode=False)
    out = torch.empty(257, dtype=torch.bfloat16)
    with pytest.warns(OpFallbackWarning, match="no C\\+\\+ compiler") as record:
        for step in range(1, 11):
            grad = torch.randn(257, generator=gen).to(torch.bfloat16)
            opt.step(grads=[grad], out16=[out])
            adam_step_reference(p64, grad.double(), m64, v64, step=step, adamw_mode=False, **HYPER)
    assert sum(issubclass(w.category, OpFallbackWarning) for w in record) == 1
    assert_fp32_close(p, p64, 10, "fallback")
    assert torch.equal(out, p.bfloat16())
