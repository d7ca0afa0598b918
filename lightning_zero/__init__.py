"""lightning_zero: DeepSpeed's ZeRO family as PyTorch Lightning strategies, natively on torch.distributed.

``import lightning_zero`` registers the strategy names (``zero0``, ``zero1``, ``zero2``, ...), so
``Trainer(strategy="zero2", precision="bf16-mixed")`` and ``Fabric(strategy="zero2")`` work, and
lets ``load_from_checkpoint`` read lightning_zero's sharded checkpoint directories.
"""

from lightning_zero.checkpoint.lightning_load import install as _install_sharded_load_from_checkpoint
from lightning_zero.config import LossScaleConfig, ZeroConfig
from lightning_zero.engines import NonFiniteStepError
from lightning_zero.fabric import ZeroFabricPrecision, ZeroFabricStrategy
from lightning_zero.precision import ZeroPrecision
from lightning_zero.registry import PRESETS, register_everywhere
from lightning_zero.strategy import ZeroStrategy

register_everywhere()
_install_sharded_load_from_checkpoint()  # checkpoint/lightning_load.py [Note: load_from_checkpoint on a directory]

__version__ = "0.1.0"
__all__ = [
    "ZeroStrategy", "ZeroFabricStrategy", "ZeroPrecision", "ZeroFabricPrecision", "ZeroConfig", "LossScaleConfig",
    "NonFiniteStepError", "PRESETS", "__version__",
]
