"""Optimizers backed by lightning_zero's compiled ops, each with a pure-torch reference.

``zero_elementwise`` on each class tells the ZeRO engine whether the math is
elementwise (then param groups may be re-pointed at flat 1-D shards) or needs
whole tensors (LAMB's per-tensor trust ratios).
"""

from lightning_zero.optim.cpu_adam import CPUAdam
from lightning_zero.optim.fused_adam import FusedAdam
from lightning_zero.optim.fused_lamb import FusedLamb

__all__ = ["CPUAdam", "FusedAdam", "FusedLamb"]

# 1-bit optimizers (compressed momentum communication; lightning_zero/comm/compressed/).
from lightning_zero.optim.onebit_adam import OneBitAdam  # noqa: E402
from lightning_zero.optim.onebit_lamb import OneBitLamb  # noqa: E402

__all__ += ["OneBitAdam", "OneBitLamb"]
