"""Builder of the low-precision host Adam op (``csrc/cpu_adam/cpu_adam_lowp*``): bf16 states with
stochastic rounding or Kahan compensation, and int8 blockwise states (see
``lightning_zero/optim/host_states.py``)."""

from __future__ import annotations

from lightning_zero.ops.builder import OpBuilder, cpu_openmp_flags


class CPUAdamLowpBuilder(OpBuilder):
    """OpenMP, auto-vectorised for AVX-512 / AVX2 / baseline in one library, picked at run time.

    ``-ffp-contract=off`` is part of the contract, not a tuning flag: the op is tested bit for bit
    against a pure-torch reference, which rounds after every multiply, so the compiler must not fuse
    a multiply and an add into one FMA. ``-fno-math-errno`` lets ``sqrtf`` vectorise (same results).
    """

    name = "cpu_adam_lowp"
    sources = ("cpu_adam/cpu_adam_lowp_binding.cpp", "cpu_adam/cpu_adam_lowp.cpp")
    fallback = "the pure-torch reference (lightning_zero.optim.reference_lowp), bit-identical and slow"

    def cxx_flags(self) -> list[str]:
        return ["-O3", "-ffp-contract=off", "-fno-math-errno", *cpu_openmp_flags()]

    def ld_flags(self) -> list[str]:
        return cpu_openmp_flags()
