"""Training callbacks that change what a step computes: Progressive Layer Dropping (pld.py)."""

from lightning_zero.callbacks.pld import (
    LayerDropPlan,
    ProgressiveLayerDrop,
    SupportsLayerDrop,
    find_layer_drop_model,
    keep_probabilities,
    theta_at,
)

__all__ = [
    "ProgressiveLayerDrop", "LayerDropPlan", "SupportsLayerDrop", "theta_at", "keep_probabilities",
    "find_layer_drop_model",
]
