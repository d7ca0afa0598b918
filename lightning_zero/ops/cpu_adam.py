"""Builder of the CPU Adam/AdamW op (``csrc/cpu_adam``)."""

from __future__ import annotations

from lightning_zero.ops.builder import OpBuilder, cpu_openmp_flags


class CPUAdamBuilder(OpBuilder):
    """OpenMP + SIMD Adam over flat fp32 buffers.

    All SIMD tiers (AVX-512, AVX2, scalar) are compiled into one library through
    function target attributes and picked at run time, so no ``-march=native``
    is needed and one cached build is safe on any x86 CPU.
    """

    name = "cpu_adam"
    sources = ("cpu_adam/cpu_adam_binding.cpp", "cpu_adam/cpu_adam.cpp")
    fallback = "torch's fused CPU Adam (torch._fused_adam_) plus separate casts"

    def cxx_flags(self) -> list[str]:
        return ["-O3", *cpu_openmp_flags()]

    def ld_flags(self) -> list[str]:
        return cpu_openmp_flags()
