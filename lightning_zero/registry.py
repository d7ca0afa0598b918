"""Strategy names -> ZeroStrategy presets, registered on ``import lightning_zero``.

Lightning has no entry point for third-party strategies, so names exist once this module has
registered them (idempotently) in ``lightning.pytorch``'s registry and, when the separate
``pytorch_lightning`` package is installed, in its registry too; and in Lightning Fabric's registry,
with the same presets, for :class:`~lightning_zero.fabric.ZeroFabricStrategy` (``pipeline`` there
refuses at construction with a message: its schedule needs the Trainer's ``training_step``).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "pipeline": {"stage": 1, "pipeline_stages": 2},
    "zero1_offload": {"stage": 1, "offload_optimizer": "cpu"},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "zero3_offload_nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"},
    # no nvme_path: it must be given (ZeroStrategy(..., nvme_path=...) or strategy.nvme_path=...); DeepSpeed's
    # /local_nvme rarely exists, and a path that always exists (the run dir, /tmp) is rarely a fast local disk
}
"""Registered name -> ZeroStrategy keyword arguments (everything else: ZeroConfig's defaults)."""

DESCRIPTIONS = {
    "zero0": "lightning_zero data parallel (flat bucketed all-reduce)",
    "zero1": "lightning_zero ZeRO stage 1 (optimizer states partitioned)",
    "zero2": "lightning_zero ZeRO stage 2 (optimizer states and gradients partitioned)",
    "zero3": "lightning_zero ZeRO stage 3 (optimizer states, gradients and parameters partitioned)",
    "pipeline": "lightning_zero pipeline parallel (2 stages, 1F1B) x ZeRO stage 1 data parallel",
    "zero1_offload": "lightning_zero ZeRO stage 1, fp32 masters and optimizer states in CPU memory (ZeRO-Offload)",
    "zero2_offload": "lightning_zero ZeRO stage 2, fp32 masters and optimizer states in CPU memory (ZeRO-Offload)",
    "zero3_offload": "lightning_zero ZeRO stage 3, optimizer states and parameters in CPU memory",
    "zero3_offload_nvme": "lightning_zero ZeRO stage 3, optimizer states and parameters on NVMe (ZeRO-Infinity)",
}


def register_all(registry: Any) -> None:
    """Register every preset into one StrategyRegistry (safe to call twice)."""
    from lightning_zero.strategy import ZeroStrategy

    for name, kwargs in PRESETS.items():
        registry.register(name, ZeroStrategy, description=DESCRIPTIONS.get(name, name), override=True, **kwargs)


def register_all_fabric(registry: Any) -> None:
    """Register every preset into one of Fabric's strategy registries (safe to call twice)."""
    from lightning_zero.fabric.strategy import ZeroFabricStrategy

    for name, kwargs in PRESETS.items():
        registry.register(name, ZeroFabricStrategy, description=DESCRIPTIONS.get(name, name), override=True, **kwargs)


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
