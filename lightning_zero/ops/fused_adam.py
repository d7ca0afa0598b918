"""Builder of the fused CUDA Adam/AdamW op (``csrc/fused_adam``)."""

from __future__ import annotations

from lightning_zero.ops.builder import CUDAOpBuilder


class FusedAdamBuilder(CUDAOpBuilder):
    """Multi-tensor Adam/AdamW kernels with device-side step counts and found-inf flag."""

    name = "fused_adam"
    sources = ("fused_adam/fused_adam_binding.cpp",)
    cuda_sources = ("fused_adam/fused_adam.cu",)
    fallback = "a Triton kernel (or torch ops without Triton)"
