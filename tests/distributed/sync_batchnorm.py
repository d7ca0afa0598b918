"""Scenario ``distributed.sync_batchnorm``: a BatchNorm conv net trained with a synchronised norm under ddp and
under ZeRO stages 1-3 (lightning_zero/layer_sync.py [Note: synchronised batch norm]).

torch's ``SyncBatchNorm`` runs on GPUs only, so on the CPU the synchronisation is :class:`GlooSyncBatchNorm`, a
``LayerSync`` plugin of the kind a user passes in ``plugins=[...]``: it swaps each BatchNorm for
:class:`AllReduceBatchNorm`, which sums each channel's count, sum and sum of squares over the world with
``torch.distributed.nn.functional.all_reduce`` (differentiable), as SyncBatchNorm does with its gathered
statistics. Lightning's ddp applies the plugin when fit starts and reverts it at teardown; the strategy must
do the same. The ranks see different samples (Lightning's DistributedSampler), so a norm that is not synced
trains differently (the ``zero2_nosync`` control). ``torch_sync``: ``Trainer(sync_batchnorm=True)`` on the
CPU, refused before any step. On GPUs (``LZ_TEST_ACCELERATOR=gpu``) the ``*_torch`` specs use torch's own
``SyncBatchNorm`` through ``sync_batchnorm=True``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import LayerSync
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from tests.helpers.launch import worker_accelerator

STEPS = 6
BATCH = 4


class AllReduceBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are the world's: per-channel count, sum and sum of squares
    all-reduced (autograd flows through the all-reduce), the running statistics updated with the unbiased
    global variance, as torch's SyncBatchNorm does."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        from torch.distributed.nn.functional import all_reduce

        n = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
        stats = torch.cat([n, x.sum(dim=(0, 2, 3)), (x * x).sum(dim=(0, 2, 3))])
        stats = all_reduce(stats)
        count = stats[0]
        c = x.shape[1]
        mean = stats[1 : 1 + c] / count
        var = stats[1 + c :] / count - mean * mean
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.mul_(1 - self.momentum).add_(mean.detach(), alpha=self.momentum)
            self.running_var.mul_(1 - self.momentum).add_(var.detach() * count / (count - 1), alpha=self.momentum)
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def _swap(module: nn.Module, to: type) -> nn.Module:
    """``module`` with every BatchNorm2d (of another class than ``to``) replaced by a ``to`` holding the same
    Parameter objects and buffers."""
    if isinstance(module, nn.BatchNorm2d) and type(module) is not to:
        new = to(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _swap(child, to))
    return module


class GlooSyncBatchNorm(LayerSync):
    """A user's LayerSync plugin that synchronises BatchNorm on the CPU."""

    def apply(self, model: nn.Module) -> nn.Module:
        return _swap(model, AllReduceBatchNorm)

    def revert(self, model: nn.Module) -> nn.Module:
        return _swap(model, nn.BatchNorm2d)


class BNConvNet(LightningModule):
    """Two conv + BatchNorm blocks and a linear head, written the plain torchvision way."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(8, 5)
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 3, 6, 6, generator=g) * torch.linspace(0.5, 2.0, 64).view(64, 1, 1, 1)
        y = torch.randint(0, 5, (64,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _norm_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().float().clone() for k, v in state.items() if "running" in k}


def run(spec: str) -> dict[str, Any]:
    """``spec``: ddp | zero1 | zero2 | zero3 (the gloo plugin) | zero2_nosync | torch_sync (refused on the CPU) |
    ddp_torch | zero1_torch | zero2_torch | zero3_torch (torch's SyncBatchNorm, ``LZ_TEST_ACCELERATOR=gpu``)."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = BNConvNet()
    kind = "zero2" if spec == "torch_sync" else spec.split("_")[0]
    strategy: Any = "ddp" if kind == "ddp" else ZeroStrategy(stage=int(kind[-1]), param_persistence_threshold=0)
    torch_sync = spec == "torch_sync" or spec.endswith("_torch")  # "<kind>_torch": torch's SyncBatchNorm (GPUs)
    plugins = [] if torch_sync or spec.endswith("_nosync") else [GlooSyncBatchNorm()]
    trainer = Trainer(
        accelerator=worker_accelerator(), devices=2, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        plugins=plugins, sync_batchnorm=torch_sync,
    )
    out: dict[str, Any] = {"error": None}
    try:
        trainer.fit(model)
    except ValueError as exc:
        out.update(error=str(exc), steps=trainer.global_step)
        return out
    full = model.state_dict() if kind == "ddp" else trainer.strategy.full_state_dict()
    out.update(
        losses=list(model.losses), norms=_norm_state(full),
        weights={k: v.detach().float().clone() for k, v in full.items() if "running" not in k},
        kinds=sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}),
        world=dist.get_world_size() if dist.is_initialized() else 1,
    )
    return out
