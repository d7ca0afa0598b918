"""Parameters unused in a step, one process (zero/unused.py [Note: parameters unused on every rank]): each
optimizer family either trains like torch's own (which leaves a ``grad=None`` parameter untouched) or stops
with one line. The two-rank parity with ddp is tests/distributed/test_skipped_units.py."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.optim.onebit_adam import OneBitAdam


class OddSkip(LightningModule):
    """A block and a side layer skipped on odd steps; ``make_opt`` builds the optimizer."""

    def __init__(self, make_opt) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.make_opt = make_opt
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        for i, block in enumerate(self.blocks):
            if not (i == 1 and step % 2 == 1):
                x = torch.tanh(block(x))
        if step % 2 == 0:
            x = x + torch.tanh(self.side(x))
        loss = ((self.head(x) - y) ** 2).mean()
        self.losses.append(float(loss))
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(16, 1), batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_opt(self.parameters())


def _fit(make_opt, strategy: object) -> tuple[list[float], dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = OddSkip(make_opt)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=5, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    weights = trainer.strategy.full_state_dict() if isinstance(strategy, ZeroStrategy) else model.state_dict()
    return model.losses, {k: v.clone() for k, v in weights.items()}


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "adam_l2": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, weight_decay=0.1),
}


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_leave_unused_parameters_as_torch_does(name: str, stage: int) -> None:
    ref_losses, ref = _fit(OPTIMIZERS[name], "auto")
    losses, got = _fit(OPTIMIZERS[name], ZeroStrategy(stage=stage, param_persistence_threshold=0))
    assert len(losses) == 5
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    for k, w in ref.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("offload", ["eager", "after_backward", "partial", "nvme"])
def test_offload_steps_leave_unused_parameters_as_torch_does(offload: str, tmp_path) -> None:
    """The CPU Adam paths under a masked step (offload/masked.py): during backward (piece by piece once counts
    differ), after backward, with a device share (offload_ratio < 1) and with NVMe states."""
    # nonfinite="ignore": the CPU step during backward (the default "skip" steps after it: config/strategy.py)
    kwargs = {"eager": dict(nonfinite="ignore"), "after_backward": dict(offload_step_in_backward=False),
              "partial": dict(offload_ratio=0.5, nonfinite="ignore"),
              "nvme": dict(offload_optimizer="nvme", nvme_path=str(tmp_path))}[offload]
    make = lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)  # noqa: E731
    ref_losses, ref = _fit(make, "auto")
    strategy = ZeroStrategy(stage=2, **{"offload_optimizer": "cpu", **kwargs})
    losses, got = _fit(make, strategy)
    assert (strategy.engines[0].eager_steps == 5) == (offload in ("eager", "partial"))
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    for k, w in ref.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=k)


def test_onebit_refuses_unused_parameters_with_one_line() -> None:
    with pytest.raises(RuntimeError, match="OneBitAdam cannot leave parameters unused on every rank unstepped"):
        _fit(lambda p: OneBitAdam(p, lr=1e-3, freeze_step=2), ZeroStrategy(stage=0))
