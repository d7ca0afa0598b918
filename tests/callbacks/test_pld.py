"""Progressive Layer Dropping (issue #19): DeepSpeed's schedule; over 200 seeded steps the executed
layers match the schedule's expectation within binomial noise; theta=1 is bitwise no PLD; evaluation
runs every layer; the decision depends on (seed, step, batch) only, so every rank draws the same
(the 2-rank zero3 run is in tests/callbacks/test_pld_distributed.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import WindowDataset  # noqa: E402
from gpt import GPT, Block, GPTConfig, GPTModule  # noqa: E402

from lightning_zero.callbacks import (  # noqa: E402
    LayerDropPlan, ProgressiveLayerDrop, SupportsLayerDrop, keep_probabilities, theta_at,
)

TINY = dict(vocab_size=256, n_layer=4, n_head=2, d_model=16, seq_len=8)


def test_schedule_is_deepspeeds() -> None:
    for theta in (0.0 + 1e-9, 0.1, 0.5, 0.9, 1.0):
        for step in (0, 1, 10, 500, 5000):
            assert theta_at(step, theta, 0.001) == (1.0 - theta) * math.exp(-0.001 * step) + theta
    assert theta_at(0, 0.5, 0.001) == 1.0  # nothing dropped at the start
    probs = keep_probabilities(4, 0.6)
    assert probs == pytest.approx((0.9, 0.8, 0.7, 0.6))  # linear in depth, the last layer at theta(t)
    assert keep_probabilities(3, 1.0) == (1.0, 1.0, 1.0)
    plan = LayerDropPlan(0, 0.6, probs, (True,) * 4)
    assert plan.scale(0) == pytest.approx(1 / 0.9)
    assert LayerDropPlan(0, 1.0, (1.0,), (True,)).scale(0) is None  # p = 1: no multiply at all
    with pytest.raises(ValueError, match="theta"):
        ProgressiveLayerDrop(theta=0.0)


def test_the_decision_depends_on_seed_step_and_batch_only() -> None:
    a, b = ProgressiveLayerDrop(theta=0.3, gamma=0.01, seed=7), ProgressiveLayerDrop(theta=0.3, gamma=0.01, seed=7)
    torch.manual_seed(1)  # global random state plays no part (ranks differ in it)
    plans_a = [a.plan_for(s, i, 12) for s in range(100, 110) for i in range(2)]
    torch.manual_seed(2)
    plans_b = [b.plan_for(s, i, 12) for s in range(100, 110) for i in range(2)]
    assert plans_a == plans_b
    other = [ProgressiveLayerDrop(theta=0.3, gamma=0.01, seed=8).plan_for(s, i, 12) for s in range(100, 110) for i in range(2)]
    assert [p.keep for p in other] != [p.keep for p in plans_a]


class _Counter(L.Callback):
    """Block calls per training batch and per validation batch, and the training losses."""

    def __init__(self) -> None:
        self.train_calls: list[int] = []
        self.val_calls: list[int] = []
        self.losses: list[torch.Tensor] = []
        self._calls = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for m in pl_module.modules():
            if isinstance(m, Block):
                m.register_forward_pre_hook(self._count)

    def _count(self, module: Any, args: Any) -> None:
        self._calls += 1

    def on_train_batch_start(self, *args: Any) -> None:
        self._calls = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.train_calls.append(self._calls)
        self.losses.append(outputs["loss"].detach().clone())

    def on_validation_batch_start(self, *args: Any) -> None:
        self._calls = 0

    def on_validation_batch_end(self, *args: Any) -> None:
        self.val_calls.append(self._calls)


def _fit(steps: int, pld: bool, theta: float = 0.5, gamma: float = 0.001, val_every: int = 0) -> tuple[_Counter, GPTModule]:
    L.seed_everything(0)
    module = GPTModule(dict(TINY, pld=pld, pld_theta=theta, pld_gamma=gamma), lr=1e-3, warmup_steps=2, max_steps=steps)
    counter = _Counter()
    tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    val = DataLoader(WindowDataset(tokens[:200], 8, 8), batch_size=4) if val_every else None
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[counter],
        limit_val_batches=2 if val_every else 0, val_check_interval=val_every or None, num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(WindowDataset(tokens, 8, 8), batch_size=2), val_dataloaders=val)
    return counter, module


def test_executed_layers_match_the_schedule_and_evaluation_runs_every_layer() -> None:
    theta, gamma, steps, n = 0.3, 0.01, 200, TINY["n_layer"]
    counter, module = _fit(steps, pld=True, theta=theta, gamma=gamma, val_every=100)
    pld = next(c for c in module.trainer.callbacks if isinstance(c, ProgressiveLayerDrop))  # added by model.pld
    assert len(counter.train_calls) == steps == len(pld.plans)
    assert counter.train_calls == [p.executed for p in pld.plans]  # dropped blocks were never called
    probs = [keep_probabilities(n, theta_at(t, theta, gamma)) for t in range(steps)]
    expected = sum(sum(p) for p in probs)
    sigma = math.sqrt(sum(q * (1 - q) for p in probs for q in p))
    executed = sum(counter.train_calls)
    assert abs(executed - expected) < 4 * sigma, (executed, expected, sigma)
    assert executed < 0.85 * steps * n  # layers were really dropped (expectation ~0.71 of all)
    # the later half drops more than the first (the schedule decays over time)
    assert sum(counter.train_calls[100:]) < sum(counter.train_calls[:100])
    assert counter.val_calls and all(c == n for c in counter.val_calls)  # evaluation: every layer
    assert module.model._layer_drop is None  # no plan left behind after fit


def test_theta_one_is_bitwise_no_pld() -> None:
    with_pld, m1 = _fit(12, pld=True, theta=1.0, gamma=0.01)
    without, m2 = _fit(12, pld=False)
    assert any(isinstance(c, ProgressiveLayerDrop) for c in m1.trainer.callbacks)
    assert not any(isinstance(c, ProgressiveLayerDrop) for c in m2.trainer.callbacks)
    assert len(with_pld.losses) == 12
    assert all(torch.equal(a, b) for a, b in zip(with_pld.losses, without.losses))


def test_protocol_and_kept_layer_scaling() -> None:
    model = GPT(GPTConfig(**TINY))
    assert isinstance(model, SupportsLayerDrop) and model.pld_num_layers() == 4
    ids = torch.randint(0, 256, (2, 8))
    model.train()
    full = model(ids)
    model.set_layer_drop(LayerDropPlan(0, 1.0, (1.0,) * 4, (True,) * 4))
    assert torch.equal(model(ids), full)  # all kept at p = 1: exactly the plain forward
    model.set_layer_drop(LayerDropPlan(5, 0.5, (0.5,) * 4, (False,) * 4))
    x = model.drop(model.wte(ids) + model.wpe(torch.arange(8)))
    torch.testing.assert_close(model(ids), torch.nn.functional.linear(model.ln_f(x), model.wte.weight))  # all dropped
    model.eval()
    torch.testing.assert_close(model(ids), full)  # evaluation ignores the plan
    with pytest.raises(ValueError, match="pld"):
        GPTModule(dict(TINY, pld=True), pipeline=True)
