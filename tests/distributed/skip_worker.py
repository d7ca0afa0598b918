"""Worker run under ``torchrun``: a block skipped on rank 1 only, on odd steps (data-dependent control
flow), under Lightning's ddp (find_unused_parameters=True) and zero3. Writes ``OUT/skip<B>_<kind>.pt``
on rank 0 with the per-step losses of rank 0. Usage: torchrun --nproc-per-node 2 skip_worker.py OUT."""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402


class SkipNet(pl.LightningModule):
    """Four blocks in a ModuleList (zero3's units); block ``skip`` is left out on rank 1 on odd steps."""

    def __init__(self, skip: int) -> None:
        super().__init__()
        self.skip = skip
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == self.skip and self.global_rank == 1 and self.trainer.global_step % 2 == 1:
                continue
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.trainer.global_step * 10 + self.global_rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        loss = ((self(x) - y) ** 2).mean()
        self.losses.append(float(loss))
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(64, 1), batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def main() -> None:
    out = sys.argv[1]
    for skip in (0, 2, 3):  # the first unit, one in the middle, the last one
        for kind in ("ddp", "zero3"):
            pl.seed_everything(0)
            model = SkipNet(skip)
            strategy = (DDPStrategy(find_unused_parameters=True) if kind == "ddp" else
                        lightning_zero.ZeroStrategy(stage=3, timeout_s=60, param_persistence_threshold=0,
                                                    bucket_size_mb=0.0005))
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 use_distributed_sampler=False)
            trainer.fit(model)
            if trainer.global_rank == 0:
                torch.save({"losses": model.losses}, os.path.join(out, f"skip{skip}_{kind}.pt"))


if __name__ == "__main__":
    main()
