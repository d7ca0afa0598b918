"""The op registry: one builder instance per op, each holding that op's build cache."""

from __future__ import annotations

from lightning_zero.ops.builder import OpBuilder
from lightning_zero.ops.cpu_adam import CPUAdamBuilder
from lightning_zero.ops.cpu_adam_lowp import CPUAdamLowpBuilder
from lightning_zero.ops.fused_adam import FusedAdamBuilder
from lightning_zero.ops.fused_lamb import FusedLambBuilder
from lightning_zero.ops.sign_pack_builders import SignPackCPUBuilder, SignPackCUDABuilder

#: Builders by op name. Their caches are the only mutable state of lightning_zero.ops.
OPS: dict[str, OpBuilder] = {
    builder.name: builder
    for builder in (
        CPUAdamBuilder(),
        CPUAdamLowpBuilder(),
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
