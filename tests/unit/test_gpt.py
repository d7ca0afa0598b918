"""The example GPT: shapes, real weight tying, activation checkpointing, FLOPs formula, param groups."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, GPTConfig, GPTModule, flops_per_token, lr_lambda, matmul_params  # noqa: E402

TINY = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=32, seq_len=16)


def _ids(batch: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, t), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_and_causality() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = _ids()
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256  # a future token must not change earlier positions
    assert torch.allclose(model(changed)[:, :-1], logits[:, :-1], atol=1e-6)
    with pytest.raises(ValueError, match="exceeds"):
        model(_ids(t=17))


def test_tied_head_is_the_embedding() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    assert model.lm_head is None
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names)
    idx = torch.zeros(2, 16, dtype=torch.long)  # only token 0 is looked up ...
    model(idx).logsumexp(-1).sum().backward()
    grad = model.wte.weight.grad
    assert grad is not None and grad[1:].abs().sum() > 0  # ... so other rows got gradient through the head
    hidden: list[torch.Tensor] = []
    model.ln_f.register_forward_hook(lambda _m, _i, out: hidden.append(out))
    with torch.no_grad():
        model.wte.weight[5].add_(1.0)  # an edit of the embedding is an edit of the head
        logits = model(_ids())
    torch.testing.assert_close(logits, torch.nn.functional.linear(hidden[-1], model.wte.weight))


def test_untied_model_has_its_own_head() -> None:
    model = GPT(replace(TINY, tie_weights=False))
    assert model.lm_head is not None
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = GPT(TINY)
    ckpt = GPT(replace(TINY, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = _ids()
    for m in (plain, ckpt):
        torch.nn.functional.cross_entropy(m(idx).view(-1, 256), idx.view(-1)).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("tie, bias", [(True, True), (False, True), (True, False)])
def test_matmul_params_match_the_module(tie: bool, bias: bool) -> None:
    cfg = replace(TINY, tie_weights=tie, bias=bias)
    model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    lookups = model.wpe.weight.numel() + (0 if tie else model.wte.weight.numel())
    assert matmul_params(cfg) == total - lookups


def test_flops_per_token_of_the_benchmark_model() -> None:
    cfg = GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024)
    n = matmul_params(cfg)
    assert 1.25e9 < n < 1.35e9  # "GPT-1.3B"
    assert flops_per_token(cfg) == 6 * n + 12 * 24 * 2048 * 1024
    # DESIGN.md section 7: 52.3k tokens/s on one H200 is 443 TFLOP/s.
    assert 52.3e3 * flops_per_token(cfg) / 1e12 == pytest.approx(443, rel=0.01)


def test_param_groups_decay_only_linear_weights() -> None:
    module = GPTModule(model=TINY)
    decay, no_decay = module.param_groups()
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in decay["params"]} | {id(p) for p in no_decay["params"]}
    assert len(ids) == len(decay["params"]) + len(no_decay["params"])  # no parameter twice
    assert ids == {id(p) for p in module.parameters()}  # every parameter once
    assert all(p.dim() == 2 for p in decay["params"])
    m = module.model
    no_decay_ids = {id(p) for p in no_decay["params"]}
    for p in (m.wte.weight, m.wpe.weight, m.ln_f.weight, m.ln_f.bias, m.blocks[0].attn.qkv.bias):
        assert id(p) in no_decay_ids


def test_configure_optimizers_and_schedule() -> None:
    module = GPTModule(model=dict(vars(TINY)), lr=1e-2, warmup_steps=4, max_steps=20, optimizer="adam")
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    assert isinstance(opt, torch.optim.Adam) and len(opt.param_groups) == 2
    assert sched["interval"] == "step"
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)  # first warm-up step
    assert lr_lambda(3, 4, 20, 0.1) == pytest.approx(1.0)
    assert lr_lambda(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_lambda(100, 4, 20, 0.1) == pytest.approx(0.1)
    sgd = GPTModule(model=TINY, optimizer="sgd", max_steps=10).configure_optimizers()["optimizer"]
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="adamw"):
        GPTModule(model=TINY, optimizer="lion")
    with pytest.raises(ValueError, match="must divide"):
        GPTConfig(vocab_size=256, n_layer=1, n_head=3, d_model=32, seq_len=8)


def test_hparams_rebuild_the_module() -> None:
    module = GPTModule(model=TINY, lr=3e-4, betas=(0.8, 0.9), max_steps=7)
    clone = GPTModule(**module.hparams)
    assert clone.config == module.config and clone.optim == module.optim and clone.max_steps == 7
