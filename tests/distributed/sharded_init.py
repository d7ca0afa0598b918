"""Scenario ``distributed.sharded_init`` (registered in scenarios.py): a model built in ``configure_model``
under zero3 is never whole on any rank.

Measures this process's peak resident memory across ``configure_model`` + ``strategy.setup`` (from
``/proc/self/status``) and returns it beside the model's full fp32 size (each rank's ``result`` record).
"""

from __future__ import annotations

import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402

import lightning_zero  # noqa: E402

WIDTH, BLOCKS = 1536, 8


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class BigNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = None
        self.rss_before = self.hwm_after = 0

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.rss_before = _status_kib("VmRSS")
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def on_fit_start(self) -> None:
        self.hwm_after = _status_kib("VmHWM")

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, WIDTH)), batch_size=2)


def run() -> dict:
    pl.seed_everything(0)
    model = BigNet()
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=lightning_zero.ZeroStrategy(stage=3, param_persistence_threshold=0),
    )
    trainer.fit(model)
    full_bytes = sum(p.numel() for p in model.parameters()) * 4
    record = {
        "rank": trainer.global_rank,
        "full_bytes": full_bytes,
        "peak_extra_bytes": (model.hwm_after - model.rss_before) * 1024,
        "shapes_true": all(p.shape == (WIDTH, WIDTH) for n, p in model.named_parameters() if n.endswith("weight")),
        "resident_param_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
    }
    return record
