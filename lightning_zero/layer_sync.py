"""``Trainer(sync_batchnorm=True)`` (and any ``LayerSync`` plugin) under the ZeRO strategy, as under ddp.

[Note: synchronised batch norm]
Lightning hands the strategy a ``LayerSync`` plugin (``TorchSyncBatchNorm`` for ``sync_batchnorm=True``, or
the user's own in ``plugins=[...]``) and leaves applying it to the strategy: ``DDPStrategy.setup`` converts
the module when fitting and ``teardown`` converts it back. A strategy that ignores it trains every
BatchNorm on its own rank's statistics while the user asked for the global batch's, with nothing said:
the ZeRO strategy did exactly that until 2026-11-29 (measured against ddp with a synced norm on CPU,
tests/distributed/test_sync_batchnorm.py: the losses part from the second step and the running
statistics differ).

Here the plugin is applied in the strategy's ``setup`` when fitting, before the engines partition the
parameters (``convert_sync_batchnorm`` builds new modules around the same Parameter objects, so the
optimizer's references hold, and stage 3's unit hooks go on the converted modules), and reverted (the
plugin's own ``revert``) at the start of ``teardown``, before the engines put their released-module guards
on the modules, as ddp reverts in its teardown. ``TorchSyncBatchNorm`` is converted over the
data-parallel group, not the world: under pipeline or tensor parallelism the world holds other stages
or copies of the same batch, and ddp's world is its data-parallel group. A plugin of the user's is
applied as it is (its ``apply(model)`` takes no group, as under ddp).

torch's ``SyncBatchNorm`` trains on GPUs only: on the CPU its first training forward raises (under ddp
too), so the combination is refused at setup, before any step, with the alternative named.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup


def _has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def apply_layer_sync(plugin: Any, model: nn.Module, dp_group: Optional[ProcessGroup], device: torch.device,
                     distributed: bool) -> nn.Module:
    """``model`` with ``plugin`` applied (the module to keep; usually ``model`` itself, converted in place).
    ``distributed``: a default process group exists (torch's SyncBatchNorm then syncs, and needs a GPU)."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    if not isinstance(plugin, TorchSyncBatchNorm):
        return plugin.apply(model)
    if distributed and device.type == "cpu" and _has_batch_norm(model):
        raise ValueError(
            "Trainer(sync_batchnorm=True) on the CPU: torch's SyncBatchNorm synchronises on GPUs only (its first "
            "training forward would raise, under ddp too). Train on GPUs, or drop sync_batchnorm (each rank's "
            "BatchNorm then uses its own micro-batch's statistics), or pass a LayerSync plugin of your own that "
            "runs on the CPU in plugins=[...]."
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=dp_group)
