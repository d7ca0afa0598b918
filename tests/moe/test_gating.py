"""lightning_zero/moe/gating.py against the per-token reference of tests/moe/reference.py: dense combine
weights and dispatch mask, capacity and dropping, dropped-token fraction, expert counts, aux loss (value
and gradient), for top-1 and top-2; eval capacity factor, min capacity and the noise policies."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero.moe.gating import TopKGate, topk_gating
from tests.moe.reference import ref_gating

CASES = [  # (tokens, experts, top_k, capacity_factor, min_capacity, drop_tokens)
    (24, 4, 1, 1.0, 0, True),
    (24, 4, 1, 0.5, 0, True),
    (17, 3, 1, 1.25, 2, True),
    (24, 4, 2, 0.5, 1, True),
    (19, 5, 2, 1.0, 0, True),
    (24, 4, 1, 1.0, 4, False),
    (19, 5, 2, 1.0, 4, False),
]


def _logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a skew towards expert 0 makes dropping happen at capacity factor 1
    return (torch.randn(tokens, experts, generator=g) * 2 + torch.linspace(1, 0, experts)).requires_grad_()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tokens,experts,top_k,factor,min_cap,drop", CASES)
def test_gating_matches_per_token_reference(tokens: int, experts: int, top_k: int, factor: float, min_cap: int,
                                            drop: bool, seed: int) -> None:
    logits = _logits(tokens, experts, seed)
    got = topk_gating(logits, top_k, factor, min_cap, drop)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = ref_gating(ref_logits, top_k, factor, min_cap, drop)

    assert got.capacity == ref.capacity
    assert torch.equal(got.dispatch_mask, ref.dispatch)
    torch.testing.assert_close(got.combine_weights, ref.combine.detach(), rtol=0, atol=1e-6)
    assert got.expert_counts.tolist() == ref.expert_counts
    assert float(got.dropped_fraction) == pytest.approx(ref.dropped_fraction, abs=1e-7)
    torch.testing.assert_close(got.aux_loss, ref.aux_loss.detach(), rtol=1e-6, atol=1e-7)
    if not drop:
        assert float(got.dropped_fraction) == 0.0 and got.capacity == max(ref.expert_counts)

    # gradients of the combine weights and of the aux loss w.r.t. the logits
    probe = torch.randn(got.combine_weights.shape, generator=torch.Generator().manual_seed(seed + 7))
    (got.combine_weights * probe).sum().add(got.aux_loss).backward()
    (ref.combine * probe).sum().add(ref.aux_loss).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


def test_cases_exercise_dropping_and_top2_renormalisation() -> None:
    """The parametrised cases are not vacuous: some drop tokens, and top-2 weights sum to 1 per full token."""
    dropped = [float(topk_gating(_logits(t, e, 0), k, f, m, d).dropped_fraction) for t, e, k, f, m, d in CASES]
    assert sum(x > 0 for x in dropped) >= 3, dropped
    r = topk_gating(_logits(19, 5, 0), 2, 1.0, 0, drop_tokens=False)
    torch.testing.assert_close(r.weights.sum(dim=1), torch.ones(19))
    r1 = topk_gating(_logits(24, 4, 0), 1, 1.0, 0, drop_tokens=False)
    torch.testing.assert_close(r1.weights[:, 0], torch.softmax(_logits(24, 4, 0), 1).max(dim=1).values)


def test_top1_dropped_fraction_counts_tokens_left_out() -> None:
    """Top-1: the dropped fraction is the share of tokens whose expert was full (all to expert 0 here)."""
    logits = torch.zeros(10, 4)
    logits[:, 0] = 5.0
    r = topk_gating(logits, 1, capacity_factor=1.0, min_capacity=0)
    assert r.capacity == math.ceil(10 / 4) == 3
    assert r.kept[:, 0].tolist() == [True] * 3 + [False] * 7  # first come, first served
    assert float(r.dropped_fraction) == pytest.approx(0.7)
    assert r.expert_counts.tolist() == [10, 0, 0, 0]


def test_capacity_follows_mode_and_min_capacity() -> None:
    torch.manual_seed(0)
    gate = TopKGate(8, 4, top_k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0)
    x = torch.randn(40, 8)
    assert gate.train()(x).capacity == 5  # ceil(40 / 4 * 0.5)
    routing = gate.eval()(x)
    assert routing.capacity == 20  # ceil(40 / 4 * 2.0)
    ref = ref_gating(x @ gate.weight.detach().t(), 1, 2.0, 0)
    assert torch.equal(routing.dispatch_mask, ref.dispatch)
    gate2 = TopKGate(8, 4, top_k=2, capacity_factor=0.5, eval_capacity_factor=1.5, min_capacity=0)
    assert gate2.train()(x).capacity == 10 and gate2.eval()(x).capacity == 30  # k x tokens / E x factor
    gate_min = TopKGate(8, 4, top_k=1, capacity_factor=0.5, min_capacity=7)
    assert gate_min(x).capacity == 7


@pytest.mark.parametrize("top_k", [1, 2])
def test_noise_policies(top_k: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    clean = TopKGate(8, 4, top_k=top_k, capacity_factor=4.0, eval_capacity_factor=4.0)
    base = clean(x)
    again = clean(x)
    assert torch.equal(base.experts, again.experts) and torch.equal(base.weights, again.weights)  # deterministic

    for policy in ("RSample", "Jitter"):
        noisy = TopKGate(8, 4, top_k=top_k, capacity_factor=4.0, eval_capacity_factor=4.0,
                         noisy_gate_policy=policy)
        noisy.load_state_dict(clean.state_dict())
        torch.manual_seed(1)
        a = noisy.train()(x)
        if policy == "RSample":
            assert not torch.equal(a.experts[:, -1], base.experts[:, -1])  # sampled choices differ somewhere
            if top_k == 2:  # the first choice stays the clean argmax, so does the aux loss
                assert torch.equal(a.experts[:, 0], base.experts[:, 0])
                torch.testing.assert_close(a.aux_loss, base.aux_loss)
            else:  # the weight is the clean probability of the sampled expert
                probs = torch.softmax(x @ clean.weight.detach().t(), 1)
                torch.testing.assert_close(a.weights[:, 0], probs.gather(1, a.experts)[:, 0])
        else:
            assert not torch.equal(a.weights, base.weights)  # jittered logits
        torch.manual_seed(1)
        b = noisy(x)
        assert torch.equal(a.experts, b.experts)  # the noise comes from torch's RNG: seeded runs repeat
        e = noisy.eval()(x)
        assert torch.equal(e.experts, base.experts) and torch.equal(e.weights, base.weights)  # no noise in eval
