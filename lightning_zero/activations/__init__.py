"""Activation memory (ZeRO-R): checkpointed regions whose checkpoints live in pinned host memory.

``checkpoint(module_or_fn, offload="cpu")`` (offload.py) and the strategy option
``ZeroStrategy(activation_offload=True)`` that applies it to every stage-3 unit (policy.py).
"""

from lightning_zero.activations.offload import (
    OFFLOAD_CHOICES,
    HostOffloader,
    OffloadStats,
    checkpoint,
    is_checkpointed,
    offloader_of,
    remove_checkpoint,
)
from lightning_zero.activations.policy import apply_activation_offload, offload_targets

__all__ = [
    "checkpoint", "remove_checkpoint", "is_checkpointed", "offloader_of", "HostOffloader", "OffloadStats",
    "OFFLOAD_CHOICES", "apply_activation_offload", "offload_targets",
]
