"""lightning_zero/moe/layer.py (and dispatch.py's local path) against the dense loop reference of
tests/moe/reference.py: outputs and gradients of every parameter and of the input, top-1/top-2, with and
without dropping; aux-loss plumbing, statistics, expert marks; bad input fails clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.moe import MoE, aux_loss, is_expert_parameter
from tests.moe.reference import MLP, ref_moe

H = 6


def _pair(top_k: int, drop: bool, factor: float = 1.0, experts: int = 4) -> tuple[MoE, MoE]:
    torch.manual_seed(3)
    layer = MoE(H, lambda: MLP(H), num_experts=experts, top_k=top_k, capacity_factor=factor, min_capacity=1,
                drop_tokens=drop, aux_loss_coef=0.1)
    twin = MoE(H, lambda: MLP(H), num_experts=experts, top_k=top_k, capacity_factor=factor, min_capacity=1,
               drop_tokens=drop, aux_loss_coef=0.1)
    twin.load_state_dict(layer.state_dict())
    return layer, twin


@pytest.mark.parametrize("top_k,drop,factor", [(1, False, 1.0), (2, False, 1.0), (1, True, 0.75), (2, True, 0.5)])
def test_layer_matches_dense_loop_reference(top_k: int, drop: bool, factor: float) -> None:
    layer, twin = _pair(top_k, drop, factor)
    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(5))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(6))

    out = layer(xa)
    ref, ref_aux = ref_moe(xb, twin.gate.weight, twin.experts, top_k, factor, 1, drop)
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.aux_loss, 0.1 * ref_aux, rtol=1e-6, atol=1e-7)
    if drop:
        assert float(layer.last_stats.dropped_fraction) > 0  # the case really drops
        dropped_rows = (out.detach().reshape(-1, H).abs().sum(1) == 0).sum()
        assert top_k == 2 or int(dropped_rows) == round(float(layer.last_stats.dropped_fraction) * 21)

    ((out * probe).sum() + layer.aux_loss).backward()
    ((ref * probe).sum() + 0.1 * ref_aux).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad if q.grad is not None else torch.zeros_like(p), rtol=1e-5,
                                   atol=1e-6, msg=name)


def test_stats_aux_loss_helper_and_expert_marks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MoE(H, lambda: MLP(H), num_experts=4, aux_loss_coef=0.5), nn.Linear(H, H),
                          MoE(H, lambda: MLP(H), num_experts=2, top_k=2, aux_loss_coef=0.25))
    assert float(aux_loss(model)) == 0.0  # nothing ran yet
    x = torch.randn(10, H)
    model(x)
    first, last = model[0], model[2]
    torch.testing.assert_close(aux_loss(model), first.aux_loss + last.aux_loss)
    assert aux_loss(model).requires_grad
    assert first.last_stats.expert_counts.sum() == 10 and last.last_stats.expert_counts.sum() == 20
    assert first.last_stats.expert_counts.shape == (4,)
    assert first.last_stats.capacity == 4  # max(min_capacity=4, ceil(10 / 4))
    marked = {n for n, p in model.named_parameters() if is_expert_parameter(p)}
    assert marked == {n for n, _ in model.named_parameters() if ".experts." in n}
    assert [first.experts[j].fc.weight.lz_expert_index for j in range(4)] == [0, 1, 2, 3]
    assert not is_expert_parameter(first.gate.weight)


def test_gate_stays_fp32_and_output_keeps_input_dtype() -> None:
    torch.manual_seed(0)
    layer = MoE(H, lambda: MLP(H), num_experts=4, drop_tokens=False).to(torch.bfloat16)
    layer.gate.float()
    x = torch.randn(5, H, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and layer.aux_loss.dtype == torch.float32


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=3), "top_k must be 1 or 2"),
    (dict(top_k=0), "top_k must be 1 or 2"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(capacity_factor=-1.0), "capacity_factor must be > 0"),
    (dict(eval_capacity_factor=0.0), "eval_capacity_factor must be > 0"),
    (dict(min_capacity=-1), "min_capacity must be >= 0"),
    (dict(noisy_gate_policy="gumbel"), "noisy_gate_policy must be one of"),
    (dict(num_experts=1, top_k=2), "must be at least top_k"),
])
def test_bad_arguments_fail_clearly(kwargs: dict, message: str) -> None:
    args = dict(num_experts=4) | kwargs
    with pytest.raises(ValueError, match=message):
        MoE(H, lambda: MLP(H), **args)


@pytest.mark.parametrize("top_k", [1, 2])
def test_empty_input_gives_empty_output_and_finite_stats(top_k: int) -> None:
    """A rank with no tokens (still part of an expert-parallel exchange) gets zeros, not NaNs."""
    layer = MoE(H, lambda: MLP(H), num_experts=4, top_k=top_k)
    x = torch.randn(0, H, requires_grad=True)
    out = layer(x)
    (out.sum() + layer.aux_loss).backward()
    assert out.shape == (0, H) and float(layer.aux_loss.detach()) == 0.0
    assert float(layer.last_stats.dropped_fraction) == 0.0 and layer.last_stats.expert_counts.sum() == 0
    assert all(p.grad is not None and not p.grad.any() for p in layer.experts.parameters())


def test_module_instead_of_factory_is_copied_per_expert() -> None:
    """DeepSpeed's ``MoE(expert=module)``: independent copies starting from the module's weights."""
    template = MLP(H)
    layer = MoE(H, template, num_experts=3)
    assert len(layer.experts) == 3 and all(e is not template for e in layer.experts)
    assert layer.experts[0].fc.weight is not layer.experts[1].fc.weight
    assert all(torch.equal(e.fc.weight, template.fc.weight) for e in layer.experts)


def test_bad_expert_factory_and_input_fail_clearly() -> None:
    with pytest.raises(TypeError, match="factory"):
        MoE(H, "mlp", num_experts=2)
    with pytest.raises(TypeError, match="must return an nn.Module"):
        MoE(H, lambda: "mlp", num_experts=2)
    layer = MoE(H, lambda: MLP(H), num_experts=2)
    with pytest.raises(ValueError, match=r"expects inputs \[\.\.\., 6\]"):
        layer(torch.randn(4, H + 1))


@pytest.mark.parametrize("top_k,factor,tokens", [(1, 0.75, 21), (2, 0.5, 21), (1, 1.5, 21), (2, 1.0, 1), (1, 1.0, 0)])
def test_fixed_capacity_dispatch_equals_sorted_dispatch(top_k: int, factor: float, tokens: int) -> None:
    """moe/capacity.py on one process: the sorted dispatch's outputs and gradients (an empty batch included)."""
    layer, twin = _pair(top_k, True, factor)
    twin.dispatch = "capacity"
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5))
    probe = torch.randn(tokens, H, generator=torch.Generator().manual_seed(6))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = layer(xa), twin(xb)
    ((out_a * probe).sum() + layer.aux_loss).backward()
    ((out_b * probe).sum() + twin.aux_loss).backward()
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=1e-6)
    for (name, a), (_, b) in zip(layer.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


def test_fixed_capacity_dispatch_needs_token_dropping() -> None:
    with pytest.raises(ValueError, match="dispatch='capacity' needs drop_tokens=True"):
        MoE(H, lambda: MLP(H), num_experts=4, drop_tokens=False, dispatch="capacity")
    with pytest.raises(ValueError, match="dispatch must be one of"):
        MoE(H, lambda: MLP(H), num_experts=4, dispatch="dense")


class _HostReads:
    """Counts ``Tensor.tolist`` / ``Tensor.item`` calls (the dispatch's ways of reading the device on the host)
    and, through torch.profiler, the operators that read it implicitly (boolean indexing's ``nonzero``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def counted(t: torch.Tensor, *args, _original=original, **kwargs):
                self.calls += 1
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("dispatch,reads", [("sorted", 1), ("capacity", 0)])
def test_host_reads_per_forward_and_backward(monkeypatch: pytest.MonkeyPatch, dispatch: str, reads: int) -> None:
    """dispatch.py [Note: one host read per layer]; capacity.py [Note: fixed-capacity dispatch]: none."""
    layer = MoE(H, lambda: MLP(H), num_experts=4, top_k=2, capacity_factor=0.75, min_capacity=1, dispatch=dispatch)
    x = torch.randn(19, H, requires_grad=True)
    counter = _HostReads(monkeypatch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (layer(x).sum() + layer.aux_loss).backward()
    assert counter.calls == reads
    names = {e.name for e in prof.events()}
    assert "aten::nonzero" not in names  # no boolean-mask indexing
    if not reads:  # (tolist itself shows as aten::item on CPU)
        assert not names & {"aten::_local_scalar_dense", "aten::item"}
