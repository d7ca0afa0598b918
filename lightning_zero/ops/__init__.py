"""Compiled ops of lightning_zero: one builder per op, JIT-built on first use and cached.

``python -m lightning_zero.ops report`` shows what is available here and why
not; ``python -m lightning_zero.ops build`` prebuilds everything compatible.
Every op has a fallback, so a missing compiler only costs speed, never an
import error. See [Note: op build cache] in ``builder.py``.
"""

from __future__ import annotations

from lightning_zero.ops.builder import (
    ENV_BUILD_DIR,
    ENV_DISABLE_JIT,
    OpBuilder,
    OpFallbackWarning,
    OpStatus,
    OpUnavailableError,
)
from lightning_zero.ops.registry import OPS, get_op
from lightning_zero.ops.sign_pack import pack_signs, unpack_signs

__all__ = [
    "ENV_BUILD_DIR",
    "ENV_DISABLE_JIT",
    "OPS",
    "OpBuilder",
    "OpFallbackWarning",
    "OpStatus",
    "OpUnavailableError",
    "get_op",
    "pack_signs",
    "unpack_signs",
]
