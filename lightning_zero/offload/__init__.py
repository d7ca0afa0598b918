"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters in host memory or on NVMe.

``engines.py`` names the offloading engine of each stage: ``engine.py`` (what all stages share) with
``flat.py`` (stages 1-2) or ``sharded.py`` (stage 3) mixed into the ZeRO engines at their marked
steps. The engine holds two objects: ``host_optimizer.py`` (masters, host gradients, ``upload.py``'s
buffers and upload state, with ``device_share.py`` (partial offload), ``compact_state.py``, ``masked.py``
and the NVMe store as members) and the step policy of ``policy.py`` (synchronous, ``eager.py`` the
step during backward, or ``delayed.py`` the delayed update); ``settings.py`` says where this rank runs
(the options are ``config/offload.py``); ``cpu.py`` runs the step on the CPU; ``pinned.py`` allocates host buffers; ``nvme.py`` does the swap-file I/O; ``swap_state.py``
and ``params.py`` keep optimizer states and stage-3 partitions in swap files; ``estimator.py`` says
what each setting needs (``python -m lightning_zero.estimate``).
"""

from lightning_zero.offload.estimator import Estimate, Setting, Workload, estimate_all, estimate_model
from lightning_zero.offload.nvme import NvmePathError, SwapFileError

__all__ = ["Estimate", "Setting", "Workload", "estimate_all", "estimate_model", "NvmePathError", "SwapFileError"]
