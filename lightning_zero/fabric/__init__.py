"""lightning_zero under Lightning Fabric: ``Fabric(strategy="zero3")`` after ``import lightning_zero``.

The same engines and the same ``ZeroConfig`` options as the Trainer's ``ZeroStrategy``; the glue both
front ends share is held, not inherited (strategy.py [Note: one engine, two front doors]): environment.py,
apply.py's ``apply_zero``, engines.py's ``Engines`` and checkpoint/strategy_io.py.
"""

from lightning_zero.fabric.precision import ZeroFabricPrecision
from lightning_zero.fabric.strategy import ZeroFabricStrategy

__all__ = ["ZeroFabricPrecision", "ZeroFabricStrategy"]
