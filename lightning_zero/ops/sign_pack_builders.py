"""Builders of the sign packing ops (``csrc/compression``), one per device."""

from __future__ import annotations

from lightning_zero.ops.builder import CUDAOpBuilder, OpBuilder, cpu_openmp_flags


class SignPackCPUBuilder(OpBuilder):
    """Pack/unpack sign bits with per-chunk scales on the CPU (OpenMP)."""

    name = "sign_pack_cpu"
    sources = ("compression/sign_pack_cpu_binding.cpp", "compression/sign_pack_cpu.cpp")
    fallback = "the pure-torch reference (lightning_zero.ops.sign_pack)"

    def cxx_flags(self) -> list[str]:
        return ["-O3", *cpu_openmp_flags()]

    def ld_flags(self) -> list[str]:
        return cpu_openmp_flags()


class SignPackCUDABuilder(CUDAOpBuilder):
    """Pack/unpack sign bits with per-chunk scales on the GPU."""

    name = "sign_pack_cuda"
    sources = ("compression/sign_pack_cuda_binding.cpp",)
    cuda_sources = ("compression/sign_pack.cu",)
    fallback = "the pure-torch reference (lightning_zero.ops.sign_pack)"
