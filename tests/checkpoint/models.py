"""Modules for the sharded-checkpoint tests: their data depend on the global step, not on the world size.

Every step ``s`` trains on one fixed *global* batch of ``GLOBAL_BATCH`` rows; with ``W`` ranks, rank
``r`` takes rows ``[r * GLOBAL_BATCH / W, (r + 1) * GLOBAL_BATCH / W)`` of it (GLOBAL_BATCH divides by
1, 2, 3 and 4). The mean over ranks of the per-rank losses is then the same global loss whatever the
world size, and so is the averaged gradient: a run resumed on 1, 3 or 4 ranks must continue the 2-rank
run's losses. The batch is picked by ``trainer.global_step`` inside ``training_step`` (the dataloader
only yields its index), so that where Lightning restarts its dataloader after a mid-epoch resume does
not matter either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH = 12
VOCAB, DIM, SEQ = 61, 64, 8
N_ROWS = GLOBAL_BATCH * 16


def _rank_world(module: LightningModule) -> tuple[int, int]:
    trainer = module._trainer
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def rank_slice(module: LightningModule, step: int) -> Tensor:
    """Row indices (into the fixed data) of this rank's slice of global batch ``step``."""
    rank, world = _rank_world(module)
    assert GLOBAL_BATCH % world == 0, (GLOBAL_BATCH, world)
    per = GLOBAL_BATCH // world
    start = step * GLOBAL_BATCH + rank * per
    return torch.arange(start, start + per) % N_ROWS


def _index_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(1000)), batch_size=1, shuffle=False)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d + 1)
        self.down = nn.Linear(4 * d + 1, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class CkptNet(LightningModule):
    """~75k parameters (about 0.9 MB of fp32 weights + Adam state, ~90 buckets of 0.01 MB): a tied
    embedding/head, a frozen layer, a buffer, two param groups, AdamW with a per-step LR schedule."""

    def __init__(self, lr: float = 3e-3, data_seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.emb.weight, std=0.1)  # tied head: logits of order 1
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM))
        g = torch.Generator().manual_seed(data_seed)
        self.register_buffer("data", torch.randint(0, VOCAB, (N_ROWS, SEQ + 1), generator=g), persistent=False)
        self.losses: list[tuple[int, float]] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        h = h + 0.1 * self.frozen(h)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h) * self.gain
        return F.linear(h, self.emb.weight)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        step = self.trainer.global_step
        rows = self.data[rank_slice(self, step)]
        x, y = rows[:, :-1], rows[:, 1:]
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append((step, float(loss.detach())))
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.95**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return _index_loader()


IMG, LATENT = 16, 8


class TinyGAN(LightningModule):
    """A GAN in Lightning's manual-optimization style (toggle/untoggle, two Adam optimizers with their
    own hyper-parameters) whose discriminator starts with a frozen feature layer (in no optimizer).
    Two optimizer steps, hence two global steps, per batch: batch ``global_step // 2`` is used."""

    def __init__(self, lr_g: float = 2e-3, lr_d: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(LATENT, 32), nn.LeakyReLU(0.2), nn.Linear(32, 48), nn.LeakyReLU(0.2),
                                       nn.Linear(48, IMG), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(IMG, 24), nn.LeakyReLU(0.2), nn.Linear(24, 32), nn.LeakyReLU(0.2),
                                           nn.Linear(32, 1), nn.Sigmoid())
        self.discriminator[0].requires_grad_(False)  # frozen features: partitioned, never trained
        g = torch.Generator().manual_seed(55)
        base = torch.linspace(-1, 1, IMG)
        real = (base * torch.rand(N_ROWS, 1, generator=g) + 0.1 * torch.randn(N_ROWS, IMG, generator=g)).tanh()
        self.register_buffer("real", real, persistent=False)
        self.g_losses: list[tuple[int, float]] = []
        self.d_losses: list[tuple[int, float]] = []

    FROZEN = "discriminator.0."

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        step = self.trainer.global_step // 2
        idx = rank_slice(self, step)
        imgs = self.real[idx]
        noise = torch.randn(N_ROWS, LATENT, generator=torch.Generator().manual_seed(1000 + step))
        z = noise[idx]
        opt_g, opt_d = self.optimizers()

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy(self.discriminator(self(z)), torch.ones(len(z), 1))
        self.g_losses.append((step, float(g_loss.detach())))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy(self.discriminator(imgs), torch.ones(len(z), 1))
        fake_loss = F.binary_cross_entropy(self.discriminator(self(z).detach()), torch.zeros(len(z), 1))
        d_loss = (real_loss + fake_loss) / 2
        self.d_losses.append((step, float(d_loss.detach())))
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr_g, betas=(0.5, 0.999))
        trainable_d = [p for p in self.discriminator.parameters() if p.requires_grad]
        opt_d = torch.optim.Adam(trainable_d, lr=self.hparams.lr_d, betas=(0.5, 0.999))
        return [opt_g, opt_d], []

    def train_dataloader(self) -> DataLoader:
        return _index_loader()


MODELS = {"net": CkptNet, "gan": TinyGAN}
