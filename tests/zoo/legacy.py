"""The deprecated hook-based weight reparametrizations, still in many GAN and vocoder repositories
(SNGAN/BigGAN discriminators, HiFi-GAN, WaveNet): ``nn.utils.spectral_norm`` and ``nn.utils.weight_norm``.

Unlike ``torch.nn.utils.parametrizations`` (tests/zoo/layouts.py), they delete ``weight`` and register a
*forward pre-hook* at build time that recomputes it from ``weight_orig`` (spectral norm, whose power-iteration
buffers ``weight_u``/``weight_v`` change in every training forward) or ``weight_g``/``weight_v`` (weight norm),
then store the result as a plain attribute. That hook is registered before any strategy's hooks, so it reads
the parameters before a stage-3 gather would run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import spectral_norm, weight_norm
from torch.utils.data import Dataset

from tests.zoo.base import ZooModule, image_data


class SNDiscriminator(nn.Module):
    """An SNGAN-style convolutional discriminator (every conv and the head spectrally normalised), with a
    weight-normalised projection as HiFi-GAN's discriminators write it."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            spectral_norm(nn.Conv2d(3, width, 3, padding=1)),
            nn.LeakyReLU(0.1),
            spectral_norm(nn.Conv2d(width, 2 * width, 4, stride=2, padding=1)),
            nn.LeakyReLU(0.1),
            weight_norm(nn.Conv2d(2 * width, 2 * width, 3, padding=1)),
            nn.LeakyReLU(0.1),
        )
        self.head = spectral_norm(nn.Linear(2 * width, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


class LegacyNorms(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = SNDiscriminator()

    def train_data(self) -> Dataset:
        return image_data((3, 8, 8), 10)

    def zoo_blocks(self) -> list[nn.Module]:
        return [m for m in self.model.blocks if isinstance(m, nn.Conv2d)]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.record(F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3, betas=(0.0, 0.9))
