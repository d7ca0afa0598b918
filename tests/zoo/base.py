"""What every zoo model shares (tests/zoo/models.py states the contract): loss recording, the sharded,
never-shuffled training loader, and the synthetic data sets (learnable token patterns, random images)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

STEPS = 12
"""Optimizer steps per run; every data set below holds more than STEPS x 2 ranks x BATCH samples."""
BATCH = 4
N_TRAIN = 128


class ZooModule(LightningModule):
    """Loss recording and the sharded, never-shuffled training loader every zoo model shares."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def train_data(self) -> Dataset:  # pragma: no cover - each model overrides
        raise NotImplementedError

    def zoo_blocks(self) -> list[nn.Module]:
        return []

    def train_dataloader(self) -> DataLoader:
        data = self.train_data()
        kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def record(self, loss: Tensor) -> Tensor:
        self.losses.append(float(loss.detach()))
        return loss


def pattern_tokens(vocab: int, n: int, length: int, seed: int, low: int = 0) -> Tensor:
    """Rows ``low + (start + stride * t) % (vocab - low)`` with a random start and stride in 1..3: random
    looking, but learnable from context, so the language models' losses fall within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - low, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return low + (start + stride * torch.arange(length)) % (vocab - low)


def token_data(vocab: int, seq: int, n: int = N_TRAIN, seed: int = 1234) -> TensorDataset:
    """Token rows split into (inputs, next-token targets); the same on every rank."""
    rows = pattern_tokens(vocab, n, seq + 1, seed)
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def image_data(shape: tuple[int, ...], classes: int, n: int = N_TRAIN, seed: int = 2024) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn((n, *shape), generator=g), torch.randint(0, classes, (n,), generator=g))
