"""Init code a model's own ``__init__`` runs after building its layers is replayed when ZeRO-3 materialises
a model built on the meta device (zero/init_replay.py [Note: init replayed, not guessed]): nanoGPT's
``apply(_init_weights)`` and scaled ``c_proj``, timm-style ``trunc_normal_``, a padding row zeroed
through a view, values copied in through ``.data``; an init that reads other meta tensors is named."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from lightning_zero.zero.materialize import materialize_modules, params_on_meta
from tests.zoo.nanogpt import GPT, GPTConfig


def _on_meta(build):  # type: ignore[no-untyped-def]
    with params_on_meta():
        model = build()
    assert all(p.is_meta for p in model.parameters())
    materialize_modules(list(model.modules()), torch.device("cpu"))
    return model


def test_nanogpt_gets_its_own_init() -> None:
    cfg = GPTConfig(block_size=32, vocab_size=512, n_layer=4, n_head=4, n_embd=256)
    torch.manual_seed(0)
    model = _on_meta(lambda: GPT(cfg))
    h = model.transformer.h
    assert model.transformer.wte.weight is model.lm_head.weight  # the tie survives
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.001  # torch's Linear draw: 0.036
    assert abs(h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001
    scaled = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(h[1].attn.c_proj.weight.std().item() / scaled - 1) < 0.05  # the scaled residual init
    assert torch.equal(h[0].mlp.c_fc.bias, torch.zeros_like(h[0].mlp.c_fc.bias))
    assert torch.equal(h[0].ln_1.weight, torch.ones_like(h[0].ln_1.weight))


class TimmStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 256, padding_idx=3)
        self.cls = nn.Parameter(torch.zeros(1, 256))
        self.head = nn.Linear(256, 512)
        nn.init.trunc_normal_(self.cls, std=0.02, a=-0.04, b=0.04)
        nn.init.trunc_normal_(self.head.weight, std=0.02, a=-0.04, b=0.04)
        self.head.bias.data.copy_(torch.arange(512.0))
        with torch.no_grad():
            self.embed.weight[5].fill_(7.0)


def test_trunc_normal_views_and_data_copies_are_replayed() -> None:
    model = _on_meta(TimmStyle)
    assert model.head.weight.abs().max() <= 0.04 + 1e-6 and abs(model.head.weight.std().item() - 0.0175) < 0.002
    assert model.cls.abs().max() <= 0.04 + 1e-6 and model.cls.abs().max() > 0
    assert torch.equal(model.head.bias, torch.arange(512.0))
    assert torch.equal(model.embed.weight[3], torch.zeros(256))  # the padding row, zeroed through a view
    assert torch.equal(model.embed.weight[5], torch.full((256,), 7.0))
    assert abs(model.embed.weight[10:].std().item() - 1.0) < 0.05  # nn.Embedding's own N(0, 1)


class Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.copy = nn.Linear(16, 16)
        nn.init.orthogonal_(self.lin.weight)
        self.copy.weight.data.copy_(self.lin.weight.data)  # reads another meta tensor: not replayable


def test_orthogonal_is_replayed_and_an_init_reading_other_meta_tensors_is_named(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_zero.zero.materialize"):
        model = _on_meta(Orthogonal)
    w = model.lin.weight.detach()
    assert torch.allclose(w @ w.T, torch.eye(16), atol=1e-5)
    assert "Linear.weight" in caplog.text and "zero_init_module" in caplog.text
    assert torch.isfinite(model.copy.weight).all()  # keeps nn.Linear's own draw


def test_nothing_is_recorded_outside_the_context() -> None:
    lin = nn.Linear(4, 4)
    nn.init.zeros_(lin.weight)
    assert not hasattr(lin.weight, "_lightning_zero_init_ops") and nn.init.trunc_normal_.__module__ == "torch.nn.init"
