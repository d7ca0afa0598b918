"""Compiled ops of lightning_zero: one builder per op, JIT-built on first use and cached.

``python -m lightning_zero.ops report`` shows what is available here and why
not; ``python -m lightning_zero.ops build`` prebuilds everything compatible.
Every op has a fallback, so a missing compiler only costs speed, never an
import error.
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
from lightning_zero.ops.cpu_adam import CPUAdamBuilder
from lightning_zero.ops.fused_adam import FusedAdamBuilder
from lightning_zero.ops.fused_lamb import FusedLambBuilder
from lightning_zero.ops.sign_pack_builders import SignPackCPUBuilder, SignPackCUDABuilder

#: One builder instance per op; each holds that op's build cache (the only mutable state).
OPS: dict[str, OpBuilder] = {
    builder.name: builder
    for builder in (
        CPUAdamBuilder(),
        FusedAdamBuilder(),
        FusedLambBuilder(),
        SignPackCPUBuilder(),
        SignPackCUDABuilder(),
    )
}


def get_op(name: str) -> OpBuilder:
    """The builder of op ``name`` (see ``OPS``)."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {sorted(OPS)}") from None


__all__ = [
    "ENV_BUILD_DIR",
    "ENV_DISABLE_JIT",
    "OPS",
    "OpBuilder",
    "OpFallbackWarning",
    "OpStatus",
    "OpUnavailableError",
    "get_op",
]
