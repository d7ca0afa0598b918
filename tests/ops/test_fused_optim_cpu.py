"""FusedAdam/FusedLamb plumbing on CPU tensors (their torch fallback path): state, flags, extras."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.optim import CPUAdam, FusedAdam, FusedLamb
from lightning_zero.optim.reference import adam_step_reference, lamb_step_reference
from tests.ops.conftest import assert_fp32_close


def test_zero_elementwise_flags() -> None:
    assert CPUAdam.zero_elementwise is True
    assert FusedAdam.zero_elementwise is True
    assert FusedLamb.zero_elementwise is False


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fused_adam_cpu_matches_reference_with_extras(adamw_mode: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(33, generator=gen), torch.randn(4, 5, generator=gen)
    refs = [[t.double(), torch.zeros_like(t, dtype=torch.float64), torch.zeros_like(t, dtype=torch.float64)] for t in (a, b)]
    opt = FusedAdam([a, b], lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    outs = [torch.empty(33, dtype=torch.bfloat16), None]
    for step in range(1, 11):
        grads = [torch.randn(t.shape, generator=gen) for t in (a, b)]
        scale = torch.tensor(4.0)
        b.grad = grads[1] * 4
        opt.step(grads=[(grads[0] * 4).bfloat16(), None], out16=outs, grad_scale=scale)
        for r, g in zip(refs, [(grads[0] * 4).bfloat16().double() / 4, grads[1].double()]):
            adam_step_reference(r[0], g, r[1], r[2], step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.1, adamw_mode=adamw_mode)  # fmt: skip
    for t, r in zip((a, b), refs):
        assert_fp32_close(t, r[0].view_as(t), 10)
    assert torch.equal(outs[0], a.bfloat16())


@pytest.mark.parametrize("cls", [FusedAdam, FusedLamb])
def test_found_inf_skips_the_step_and_the_count(cls: type) -> None:
    p = torch.randn(10)
    p.grad = torch.randn(10)
    opt = cls([p])
    opt.step()
    before = p.clone()
    opt.found_inf = torch.tensor(1.0)  # as GradScaler sets it
    opt.grad_scale = torch.tensor(1.0)
    opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 1
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert not torch.equal(p, before) and opt.state[p]["step"].item() == 2


def test_fused_lamb_cpu_matches_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randn(50, generator=gen), torch.zeros(7), torch.randn(3, 3, generator=gen)]
    refs = [[p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)] for p in ps]
    opt = FusedLamb(ps, lr=1e-2, weight_decay=0.01)
    for step in range(1, 8):
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        opt.step(grads=grads)
        for r, g in zip(refs, grads):
            lamb_step_reference(r[0], g.double(), r[1], r[2], step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.01, max_coeff=10.0, min_coeff=0.01, bias_correction=True)  # fmt: skip
    for p, r in zip(ps, refs):
        assert_fp32_close(p, r[0], 7)


def test_lamb_reference_trust_ratio() -> None:
    """Hand-checked: step 1 with bias correction makes the Adam update ~sign(g); ratio = ||p|| / ||u||."""
    p = torch.tensor([3.0, 4.0], dtype=torch.float64)
    g = torch.tensor([1.0, -1.0], dtype=torch.float64)
    ratio = lamb_step_reference(p, g, torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                                step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=0.0, weight_decay=0.0,
                                max_coeff=10.0, min_coeff=0.01, bias_correction=True)  # fmt: skip
    assert ratio.item() == pytest.approx(5 / 2**0.5)
    assert p.tolist() == pytest.approx([3 - 0.1 * 5 / 2**0.5, 4 + 0.1 * 5 / 2**0.5])


def test_fused_adam_state_dict_is_torch_adams() -> None:
    p = torch.randn(10)
    p.grad = torch.randn(10)
    ours = FusedAdam([p], lr=1e-2)
    ours.step()
    q = p.clone()
    q.grad = p.grad.clone()
    theirs = torch.optim.AdamW([q], lr=1e-2)
    theirs.load_state_dict(ours.state_dict())
    ours.step()
    theirs.step()
    torch.testing.assert_close(p, q)
