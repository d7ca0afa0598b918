"""Builder of the fused CUDA LAMB op (``csrc/lamb``)."""

from __future__ import annotations

from lightning_zero.ops.builder import CUDAOpBuilder


class FusedLambBuilder(CUDAOpBuilder):
    """Multi-tensor LAMB: moments and per-tensor norms, trust ratios, then the update."""

    name = "fused_lamb"
    sources = ("lamb/lamb_binding.cpp",)
    cuda_sources = ("lamb/lamb.cu",)
    fallback = "per-tensor torch ops (the reference math in fp32)"
