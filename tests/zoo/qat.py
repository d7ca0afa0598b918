"""Quantization-aware training as PyTorch's recipe writes it: ``fuse_modules_qat`` then ``prepare_qat`` with
``get_default_qat_qconfig("fbgemm")`` on a small conv net, with gradient accumulation.

:class:`QATConvNet` ("qat"): the fake quants' observers (``FusedMovingAvgObsFakeQuantize``) update their
buffers in every forward inside one fused kernel that moves no version counter, and the fused ``ConvBnReLU2d``
scales its weight by the BatchNorm's ``running_var`` in the training forward. ddp broadcasts rank 0's buffers
before a forward that follows a reducing training forward only (not after an accumulating micro-batch, nor
after a validation batch). Every stage trained apart from ddp (2e-2 in the losses without accumulation: the
observers were never broadcast; 7e-4 with it: the BatchNorm was broadcast after every micro-batch) until
zero/buffers.py followed both ([Note: buffer sync]). Validation runs on each rank's own batches, with the
observers still observing, as they do in eval mode.
"""

from __future__ import annotations

import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.zoo.base import ZooModule, image_data

SHAPE = (3, 8, 8)
CLASSES = 10


class QuantBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # before a BatchNorm: no gradient
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, CLASSES)
        self.dequant = tq.DeQuantStub()

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn(self.conv(self.quant(x))))
        x = self.pool(self.relu2(self.conv2(x))).flatten(1)
        return self.dequant(self.fc(x))


class QATConvNet(ZooModule):
    VAL_EVERY = 4
    ACCUMULATE = 2

    def __init__(self) -> None:
        super().__init__()
        body = tq.fuse_modules_qat(QuantBody().train(), [["conv", "bn", "relu"], ["conv2", "relu2"]])
        body.qconfig = tq.get_default_qat_qconfig("fbgemm")
        self.body = tq.prepare_qat(body)

    def train_data(self) -> Dataset:
        return image_data(SHAPE, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.record(F.cross_entropy(self(x), y))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(float(F.cross_entropy(self(x), y)))

    def val_dataloader(self) -> DataLoader:
        data = image_data(SHAPE, CLASSES, n=32, seed=7)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False, **kwargs))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
