"""The pipeline parity model: a tied embedding, N blocks, a LayerNorm and the embedding reused as head.

The same LightningModule trains under a single-device strategy (layers run in sequence: the
reference) and under ZeroStrategy with pipeline stages; it records per-step losses, validation
losses and the gradient norm before clipping.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import Any, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, DIM, SEQ = 37, 24, 8


ALLOC_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
FILL_OPS = frozenset({"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like", "new_full", "ones",
                      "ones_like", "new_ones"})
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal"})
"""Ops that read a device value on the host (on a GPU each one waits for every kernel queued before it)."""


class AllocCounter(TorchDispatchMode):
    """Counts the allocations, fills (on a GPU each fill is a kernel or a memset) and host synchronisations
    dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in ALLOC_OPS or name in FILL_OPS or name in SYNC_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class RandomTokens(Dataset):
    def __init__(self, n: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d + 1)
        self.down = nn.Linear(3 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def head(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, embedding.weight)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


class CarryBlock(Block):
    """A block on ``(h, c)`` that reads ``c`` and passes it on unchanged (as T5 passes its position bias from
    block to block): a stage holding only such blocks sends on the very tensor it received, and the gradient
    it receives for ``c`` flows straight into its input's ``.grad`` (pipeline/buffers.py's aliasing cases)."""

    def forward(self, hc: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h, c = hc
        return super().forward(h) + 0.1 * c, c


def start_carry(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return h, 0.5 * h


def drop_carry(hc: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return hc[0]


def layer_specs(blocks: int, carry: bool = False) -> list:
    body = [LayerSpec(Block, DIM) for _ in range(blocks)]
    if carry:
        body = [start_carry, *[LayerSpec(CarryBlock, DIM) for _ in range(blocks)], drop_carry]
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        *body,
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head),
    ]


class PipeNet(LightningModule):
    def __init__(
        self, blocks: int = 4, partition: Union[str, list[int]] = "parameters", global_batch: int = 8,
        n_train: int = 80, lr: float = 3e-3, checkpoint_interval: int = 0, carry: bool = False,
    ) -> None:
        super().__init__()
        self.pipe = PipelineModule(
            layer_specs(blocks, carry), token_loss, partition=partition, activation_checkpoint_interval=checkpoint_interval
        )
        self.global_batch = global_batch
        self.n_train = n_train
        self.lr = lr
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.count_allocations = False
        self.allocations: list[dict[str, int]] = []
        """With ``count_allocations``: allocations and fills of each training step's ``pipe(batch)``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        counter = AllocCounter() if self.count_allocations else nullcontext()
        with counter:
            loss = self.pipe(batch)
        if isinstance(counter, AllocCounter):
            self.allocations.append(dict(counter.counts))
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.pipe(batch)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "tied" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "tied" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _replicas(self) -> dict[str, int]:
        return getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}

    def train_dataloader(self) -> DataLoader:
        kwargs = self._replicas()
        data = RandomTokens(self.n_train)
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=self.global_batch // kwargs["num_replicas"], sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(12, seed=99), batch_size=6)


class GradNormProbe(Callback):
    """Global gradient norm before clipping: the strategy's when it has one, else computed here."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self._step = 0

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not hasattr(trainer.strategy, "grad_norm"):
            grads = [p.grad.detach().double() for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.sqrt(sum((g * g).sum() for g in grads))))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if hasattr(trainer.strategy, "grad_norm") and trainer.global_step > self._step:  # an optimizer step ran
            self.norms.append(float(trainer.strategy.grad_norm))
        self._step = trainer.global_step
