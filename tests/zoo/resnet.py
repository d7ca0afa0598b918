"""7. A torchvision-style ResNet: BatchNorm buffers, whose running statistics must stay as ddp keeps them."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from tests.zoo.base import ZooModule, image_data


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, int, int, int] = (1, 1, 1, 1), widths: tuple[int, ...] = (4, 8, 16, 32),
                 num_classes: int = 10) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(widths[0], layers[0])
        self.layer2 = self._make_layer(widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * BasicBlock.expansion, stride),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


class TorchvisionResNet(ZooModule):
    """BatchNorm running stats: ddp broadcasts rank 0's buffers before each forward (the first
    validation batch included), so every rank validates with rank 0's statistics."""

    VAL_EVERY = 4

    def __init__(self) -> None:
        super().__init__()
        self.model = ResNet()

    def train_data(self) -> Dataset:
        return image_data((3, 32, 32), 10)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.record(F.cross_entropy(self.model(x), y))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(image_data((3, 32, 32), 10, n=16, seed=99), batch_size=8, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


class ChannelsLastConvNet(ZooModule):
    """``model.to(memory_format=torch.channels_last)`` (timm's ``--channels-last``, torchvision's recipes):
    every 4-d weight and its gradient has NHWC strides, which a flat buffer must not read as NCHW.

    Lightning's ``ddp`` runs the same net in the default layout: on CPU, torch 2.13's channels_last backward of
    a strided 1x1 convolution (ResNet's downsample) corrupts the heap with one thread, under ddp as anywhere, so
    this net has no 1x1 strided convolution and ddp, the oracle, keeps NCHW (the same values, other strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )
        self.channels_last = False

    def setup(self, stage: str) -> None:
        self.channels_last = type(self.trainer.strategy).__name__ != "DDPStrategy"
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)

    def train_data(self) -> Dataset:
        return image_data((3, 32, 32), 10)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        if self.channels_last:
            x = x.to(memory_format=torch.channels_last)
        return self.record(F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
