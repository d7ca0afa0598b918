"""8. Lightning's GAN recipe: two optimizers, manual optimization, ``toggle_optimizer`` / ``untoggle_optimizer``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from tests.zoo.base import N_TRAIN, ZooModule


class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 32, normalize=False),
            *block(32, 64),
            *block(64, 128),
            nn.Linear(128, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        img = self.model(z)
        img = img.view(img.size(0), *self.img_shape)
        return img


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 64),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(64, 32),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(32, 1),
            nn.Sigmoid(),
        )

    def forward(self, img: Tensor) -> Tensor:
        img_flat = img.view(img.size(0), -1)
        validity = self.model(img_flat)
        return validity


class GAN(ZooModule):
    """Lightning's basic GAN tutorial, step for step (manual optimization, toggle/untoggle).

    One deviation: the noise comes from a generator seeded by (step, rank) instead of the global RNG,
    so that the comparison with ddp does not depend on how much global randomness a strategy consumes.
    """

    def __init__(self, channels: int = 1, width: int = 8, height: int = 8, latent_dim: int = 16, lr: float = 2e-3,
                 b1: float = 0.5, b2: float = 0.999) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        data_shape = (channels, width, height)
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=data_shape)
        self.discriminator = Discriminator(img_shape=data_shape)
        self.g_losses: list[float] = []
        self.d_losses: list[float] = []

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def zero_gradient_names(self) -> list[str]:
        """The biases of the generator's Linear layers that feed a BatchNorm, and that BatchNorm's
        running mean. BatchNorm subtracts the batch mean, so in exact arithmetic these biases get no
        gradient; in floating point they get noise (~1e-10, below Adam's eps) that Adam still turns
        into steps of ~lr/100. Any optimizer implementation that is not bitwise torch's (the compiled
        CPU Adam of ``zero3_offload``: ~5e-8 on every other tensor) changes that noise completely, so
        these tensors drift apart by ~1e-3 while every loss still matches: they are compared loosely."""
        layers = list(self.generator.model)
        names = []
        for i, (layer, nxt) in enumerate(zip(layers, layers[1:])):
            if isinstance(layer, nn.Linear) and isinstance(nxt, nn.BatchNorm1d):
                names += [f"generator.model.{i}.bias", f"generator.model.{i + 1}.running_mean"]
        return names

    def adversarial_loss(self, y_hat: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy(y_hat, y)

    def train_data(self) -> Dataset:
        g = torch.Generator().manual_seed(55)
        c, w, h = self.hparams.channels, self.hparams.width, self.hparams.height
        base = torch.linspace(-1, 1, w * h).view(1, c, w, h)
        imgs = (base * torch.rand(N_TRAIN, 1, 1, 1, generator=g) + 0.1 * torch.randn(N_TRAIN, c, w, h, generator=g)).tanh()
        return TensorDataset(imgs, torch.zeros(N_TRAIN, dtype=torch.long))

    def _noise(self, n: int) -> Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_step + self.trainer.global_rank)
        return torch.randn(n, self.hparams.latent_dim, generator=g)

    def training_step(self, batch: tuple[Tensor, Tensor]) -> None:
        imgs, _ = batch

        optimizer_g, optimizer_d = self.optimizers()

        # sample noise
        z = self._noise(imgs.shape[0])
        z = z.type_as(imgs)

        # train generator
        # generate images
        self.toggle_optimizer(optimizer_g)
        self.generated_imgs = self(z)

        # ground truth result (ie: all fake)
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        # adversarial loss is binary cross-entropy
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.g_losses.append(float(g_loss.detach()))
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # train discriminator
        # Measure discriminator's ability to classify real from generated samples
        self.toggle_optimizer(optimizer_d)

        # how well can it label as real?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        # how well can it label as fake?
        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        # discriminator loss is the average of these
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.d_losses.append(float(d_loss.detach()))
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []
