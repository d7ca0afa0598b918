"""A small LightningModule with every awkward shape the ZeRO engines must handle.

Tied weights (embedding reused as the output head through ``F.linear``), a frozen layer, a buffer,
a block called twice in one forward,
a parameter used only on some ranks in some steps, activation checkpointing, parameter sizes that
do not divide by 2, 3 or 4, two param groups (no weight decay on biases/norms), an LR scheduler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB, DIM, SEQ = 37, 23, 9


class RandomTokens(Dataset):
    """Fixed random token sequences (next-token targets), identical on every rank."""

    def __init__(self, n: int = 512, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[i]
        return row[:-1], row[1:]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d + 1)
        self.down = nn.Linear(3 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ParityNet(LightningModule):
    def __init__(
        self, lr: float = 3e-3, optimizer: str = "adamw", checkpointing: bool = True, inject_inf_at: int = -1,
        n_train: int = 512,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.sometimes = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM))
        self.lr = lr
        self.optimizer_name = optimizer
        self.checkpointing = checkpointing
        self.losses: list[float] = []
        self.inject_inf_at = inject_inf_at
        self.n_train = n_train
        self.sometimes_every = 2
        """``sometimes`` is used when (step + rank) % this == 0: 2 leaves it unused on every rank of a
        one-process run every other step; 1 uses it always (1-bit optimizers refuse unused parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + 0.1 * self.frozen(h)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointing and self.training else block(h)
        h = self.blocks[1](h)  # one module called twice in a forward
        rank = self.trainer.global_rank if self._trainer is not None else 0
        if self.training and (self.global_step + rank) % self.sometimes_every == 0:
            h = h + self.sometimes(h)  # used on one of two ranks per step: needs no flag
        h = self.norm(h) * self.gain
        return F.linear(h, self.emb.weight)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        self.log("loss", loss, sync_dist=False)
        if self.global_step == self.inject_inf_at and self.trainer.global_rank == 1:
            loss = loss * float("inf")  # an fp16 overflow on one rank only: every rank must skip
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr * 10, momentum=0.9)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr)
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        # Our own sampler (the Trainer runs with use_distributed_sampler=False): Lightning's automatic
        # one reshuffles every epoch in a way a resumed run does not reproduce, under ddp too.
        kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(RandomTokens(self.n_train), shuffle=False, **kwargs)
        return DataLoader(RandomTokens(self.n_train), batch_size=4, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(64, seed=99), batch_size=8, shuffle=False)
