"""Optimizers backed by lightning_zero's compiled ops, each with a pure-torch reference.

``zero_elementwise`` on each class tells the ZeRO engine whether the math is
elementwise (then param groups may be re-pointed at flat 1-D shards) or needs
whole tensors (LAMB's per-tensor trust ratios).
"""

from lightning_zero.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
