"""Compressed communication: 1-bit error-compensated all-reduce for OneBitAdam / OneBitLamb.

``sign.py`` packs signs (compiled kernels or plain torch), ``onebit_allreduce.py`` is the algorithm
and its plain-torch oracle, ``backend.py`` runs it over a process group through
``lightning_zero.comm.collectives``, ``protocol.py`` is the contract between strategy and optimizer.
"""

from lightning_zero.comm.compressed.backend import (
    DEFAULT_BLOCK,
    CommCounters,
    CompressedBackend,
    TorchDistBackend,
    allreduce_bytes,
    wire_bytes,
)
from lightning_zero.comm.compressed.onebit_allreduce import ErrorFeedback, OneBitLayout, simulate_onebit_allreduce
from lightning_zero.comm.compressed.protocol import (
    COMM_STATE_KEY,
    CompressedCommOptimizer,
    add_comm_state,
    attach_backend,
    gradient_allreduce_needed,
    local_comm_state,
    restore_comm_state,
    uses_compressed_comm,
)
from lightning_zero.comm.compressed.sign import (
    KernelSignCompressor,
    SignCompressor,
    TorchSignCompressor,
    default_compressor,
    make_compressor,
)

__all__ = [
    "COMM_STATE_KEY", "DEFAULT_BLOCK", "CommCounters", "CompressedBackend", "CompressedCommOptimizer",
    "ErrorFeedback", "KernelSignCompressor", "OneBitLayout", "SignCompressor", "TorchDistBackend",
    "TorchSignCompressor", "add_comm_state", "allreduce_bytes", "attach_backend", "default_compressor",
    "gradient_allreduce_needed", "local_comm_state", "make_compressor", "restore_comm_state", "simulate_onebit_allreduce",
    "uses_compressed_comm", "wire_bytes",
]
