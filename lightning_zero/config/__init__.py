"""Typed configuration dataclasses: the single source of every default in lightning_zero."""

from lightning_zero.config.strategy import VALID_STAGES, LossScaleConfig, ZeroConfig

__all__ = ["ZeroConfig", "LossScaleConfig", "VALID_STAGES"]
