"""OneBitAdam / OneBitLamb on one process: warm-up is the exact optimizer, flat segments, state, errors."""

from __future__ import annotations

import io
import logging
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.comm.compressed import CommCounters, ErrorFeedback, OneBitLayout
from lightning_zero.optim import FusedLamb, OneBitAdam, OneBitLamb
from tests.helpers.parity_model import ParityNet


def _pairs(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(10, 5, generator=g).requires_grad_(), torch.randn(7, generator=g).requires_grad_()]
    return ps, [p.detach().clone().requires_grad_() for p in ps]


def _run(a: torch.optim.Optimizer, b: torch.optim.Optimizer, ps: list, qs: list, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, q in zip(ps, qs):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()


@pytest.mark.parametrize(
    ("kwargs", "torch_cls", "torch_kwargs"),
    [
        ({}, torch.optim.Adam, {}),
        ({"weight_decay": 0.1}, torch.optim.AdamW, {"weight_decay": 0.1}),
        ({"weight_decay": 0.1, "adamw_mode": False}, torch.optim.Adam, {"weight_decay": 0.1}),
    ],
)
def test_adam_warmup_is_torch_adam(kwargs: dict, torch_cls: type, torch_kwargs: dict) -> None:
    ps, qs = _pairs()
    a = OneBitAdam(ps, lr=1e-2, freeze_step=1000, **kwargs)
    b = torch_cls(qs, lr=1e-2, **torch_kwargs)
    _run(a, b, ps, qs, 25)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert a.phase == "warmup" and a.needs_gradient_allreduce()


def test_lamb_warmup_is_fused_lamb() -> None:
    ps, qs = _pairs()
    a = OneBitLamb(ps, lr=1e-2, freeze_step=1000, weight_decay=0.01)
    b = FusedLamb(qs, lr=1e-2, weight_decay=0.01)
    _run(a, b, ps, qs, 25)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_phase_switch_freezes_the_variance(cls: type) -> None:
    ps, qs = _pairs()
    opt = cls(ps, lr=1e-2, freeze_step=3)
    for step in range(1, 7):
        assert opt.needs_gradient_allreduce() == (step <= 3)
        for p in ps:
            p.grad = torch.randn_like(p)
        before = [opt.state[p]["exp_avg_sq"].clone() for p in ps if p in opt.state]
        opt.step()
        if step > 3:
            assert all(torch.equal(b, opt.state[p]["exp_avg_sq"]) for b, p in zip(before, ps))
    assert opt.phase == "compressed" and opt.comm_stats["onebit/phase"] == 1.0


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_flat_parameter_with_segments_equals_separate_tensors(cls: type) -> None:
    """What the ZeRO engine does: one flat buffer with padding between tensors, boundaries passed in."""
    ps, _ = _pairs()
    spans = [(0, 50), (56, 7)]  # 6 and 1 padding elements, as the engine's 8-alignment leaves
    flat = torch.zeros(64)
    for p, (o, n) in zip(ps, spans):
        flat[o : o + n] = p.detach().reshape(-1)
    flat.requires_grad_()
    a = cls(ps, lr=1e-2, freeze_step=4, weight_decay=0.1)
    b = cls([flat], lr=1e-2, freeze_step=4, weight_decay=0.1)
    b.bind_flat_params(flat, spans)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        grad = torch.zeros(64)
        for p, (o, n) in zip(ps, spans):
            p.grad = torch.randn(p.shape, generator=g)
            grad[o : o + n] = p.grad.reshape(-1)
        flat.grad = grad
        a.step()
        b.step()
    for p, (o, n) in zip(ps, spans):
        torch.testing.assert_close(flat.detach()[o : o + n], p.detach().reshape(-1), rtol=1e-5, atol=1e-6)
    assert flat.detach()[50:56].abs().max() == 0 and flat.detach()[63] == 0  # padding never moves
    with pytest.raises(ValueError, match=r"stage\(s\) \[0\]"):
        b.bind_flat_params(flat, spans, sharded=True)


def test_bad_freeze_step() -> None:
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam([torch.zeros(2, requires_grad=True)], freeze_step=0)


class _FakeBackend:
    """Two 'ranks' seen from rank ``rank``: a deterministic stand-in that moves the error buffers."""

    def __init__(self, world_size: int = 2, rank: int = 0) -> None:
        self.world_size, self.rank, self.counters = world_size, rank, CommCounters()

    def new_errors(self, numel: int, device: torch.device) -> ErrorFeedback:
        return ErrorFeedback.zeros(OneBitLayout.plan(numel, self.world_size, 64), device)

    def compressed_average_(self, tensor: torch.Tensor, errors: ErrorFeedback) -> torch.Tensor:
        x = tensor.view(-1) + errors.worker[: tensor.numel()]
        sent = x.sign() * x.abs().mean()
        errors.worker[: tensor.numel()] = x - sent
        errors.server.add_(0.01)
        tensor.view(-1).copy_(sent)
        self.counters.bytes_sent += tensor.numel() / 8
        return tensor

    def gather_to_root(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        return [tensor.cpu().clone() for _ in range(self.world_size)]


def _train(opt: torch.optim.Optimizer, ps: list, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in ps]


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_state_dict_restores_phase_statistics_and_errors(cls: type, caplog: pytest.LogCaptureFixture) -> None:
    ps, qs = _pairs()
    a = cls(ps, lr=1e-2, freeze_step=3, comm_backend=_FakeBackend())
    _train(a, ps, 6, seed=0)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)  # as a checkpoint would (torch's load_state_dict aliases tensors)
    buffer.seek(0)
    sd = torch.load(buffer, weights_only=False)
    assert sd["compressed_comm"]["errors"][0]  # this rank's error buffers are in it
    gathered = a.gather_comm_state()
    assert set(gathered["errors"]) == {0, 1}
    for q, p in zip(qs, ps):
        q.data.copy_(p.data)
    b = cls(qs, lr=1e-2, freeze_step=3, comm_backend=_FakeBackend())
    b.load_state_dict(sd)
    assert b.phase == "compressed" and not b.needs_gradient_allreduce()
    assert all(torch.equal(x, y) for x, y in zip(_train(a, ps, 4, seed=1), _train(b, qs, 4, seed=1)))
    # resumed on another world size: errors restart from zero, and a log line says so
    c = cls([q.detach().clone().requires_grad_() for q in qs], lr=1e-2, freeze_step=3, comm_backend=_FakeBackend(3))
    c.load_state_dict(sd)
    with caplog.at_level(logging.WARNING):
        _train(c, c.param_groups[0]["params"], 1, seed=2)
    assert "restart from zero" in caplog.text and "2 ranks" in caplog.text


def test_comm_stats_report_both_phases() -> None:
    ps, _ = _pairs()
    opt = OneBitAdam(ps, lr=1e-2, freeze_step=2, comm_backend=_FakeBackend())
    _train(opt, ps, 1, seed=0)
    warm = opt.comm_stats
    assert warm["onebit/phase"] == 0.0 and warm["onebit/bytes_sent"] == warm["onebit/bytes_16bit_allreduce"] > 0
    _train(opt, ps, 3, seed=0)
    stats = opt.comm_stats
    assert stats["onebit/phase"] == 1.0
    assert stats["onebit/bytes_sent_total"] > warm["onebit/bytes_sent"]
    assert set(stats) == {
        "onebit/phase", "onebit/bytes_sent", "onebit/bytes_16bit_allreduce", "onebit/bytes_sent_total",
        "onebit/bytes_16bit_allreduce_total", "onebit/compression_ratio",
    }


class OneBitNet(ParityNet):
    def __init__(self, cls: type, **kw: Any) -> None:
        super().__init__(checkpointing=False, n_train=64)
        self.cls, self.kw = cls, kw
        self.sometimes_every = 1  # one process: a parameter no rank uses would be refused (zero/unused.py)

    def configure_optimizers(self) -> Any:
        return self.cls(self.parameters(), lr=1e-2, **self.kw)


def _trainer(stage: int, steps: int = 6) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0,
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unsupported_stage_is_a_clear_error_before_training(stage: int) -> None:
    model = OneBitNet(OneBitAdam, freeze_step=2)
    with pytest.raises(ValueError, match=rf"stage\(s\) \[0\] only, got stage {stage}.*zero0"):
        _trainer(stage).fit(model)
    assert model.losses == []


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_zero0_single_process_runs_both_phases(cls: type) -> None:
    model = OneBitNet(cls, freeze_step=2)
    trainer = _trainer(0)
    trainer.fit(model)
    opt = trainer.optimizers[0]
    assert opt.phase == "compressed" and opt.comm_backend is not None
    assert all(not e.reduce_gradients for e in trainer.strategy.engines)  # the engine's all-reduce is off
    assert len(model.losses) == 6 and all(torch.isfinite(torch.tensor(model.losses)))
