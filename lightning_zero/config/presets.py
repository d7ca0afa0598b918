"""The registered strategy names and their ZeroStrategy keyword arguments (data, no imports).

Here, not in ``registry.py``, so that ``ZeroStrategy.register_strategies`` and
``ZeroFabricStrategy.register_strategies`` read them without importing the registry, which imports
both strategies (that was an import cycle: registry <-> strategy <-> fabric).
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



def register_presets(registry: Any, strategy_cls: type) -> None:
    """Register every preset of ``strategy_cls`` into one strategy registry (safe to call twice)."""
    for name, kwargs in PRESETS.items():
        registry.register(name, strategy_cls, description=DESCRIPTIONS.get(name, name), override=True, **kwargs)
