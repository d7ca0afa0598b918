"""Strategy names -> ZeroStrategy presets, registered on ``import lightning_zero``.

Lightning has no entry point for third-party strategies, so names exist once this module has
registered them (idempotently) in ``lightning.pytorch``'s registry and, when the separate
``pytorch_lightning`` package is installed, in its registry too; and in Lightning Fabric's registry,
with the same presets, for :class:`~lightning_zero.fabric.ZeroFabricStrategy` (``pipeline`` there
refuses at construction with a message: its schedule needs the Trainer's ``training_step``).
"""

from __future__ import annotations

from typing import Any

from lightning_zero.config.presets import DESCRIPTIONS, PRESETS, register_presets
from lightning_zero.fabric.strategy import ZeroFabricStrategy
from lightning_zero.strategy import ZeroStrategy


def register_all(registry: Any) -> None:
    """Register every preset into one StrategyRegistry (safe to call twice)."""
    register_presets(registry, ZeroStrategy)


def register_all_fabric(registry: Any) -> None:
    """Register every preset into one of Fabric's strategy registries (safe to call twice)."""
    register_presets(registry, ZeroFabricStrategy)


def register_everywhere() -> None:
    """Register into lightning.pytorch's registry (pytorch_lightning's when installed) and Fabric's."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    register_all(StrategyRegistry)
    register_all_fabric(STRATEGY_REGISTRY)
    try:
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
    except Exception:  # pytorch_lightning not installed: nothing to do
        return
    register_all(PLRegistry)
