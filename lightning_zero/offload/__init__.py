"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters in host memory or on NVMe.

``engine.py`` mixes offload into the ZeRO engines at their marked steps; ``cpu.py`` runs the step on
the CPU; ``pinned.py`` allocates host buffers; ``nvme.py`` does the swap-file I/O; ``swap_state.py``
and ``params.py`` keep optimizer states and stage-3 partitions in swap files; ``estimator.py`` says
what each setting needs (``python -m lightning_zero.estimate``).
"""

from lightning_zero.offload.estimator import Estimate, Setting, Workload, estimate_all, estimate_model
from lightning_zero.offload.nvme import NvmePathError, SwapFileError

__all__ = ["Estimate", "Setting", "Workload", "estimate_all", "estimate_model", "NvmePathError", "SwapFileError"]
