"""The injected errors' messages, shared by tests/faults/fault_runs.py and the tests (which must not
import the worker: it replaces the streams of the process that runs it)."""

from __future__ import annotations

MARK = "FAULT-INJECTED"
"""Every injected error's message contains this (the tests grep for the whole message)."""


def fault_message(kind: str, at: int) -> str:
    """The exact text of the error injected by fault ``kind`` at global step ``at``."""
    return {
        "train_step": f"{MARK} training_step error on rank 1 at global step {at}",
        "slowclean": f"{MARK} training_step error on rank 1 at global step {at}",
        "batch_end": f"{MARK} on_train_batch_end error on rank 1 after global step {at}",
        "nvme_eio": f"{MARK} EIO in NVMe I/O thread on rank 1",
        "nvme_enospc": f"{MARK} ENOSPC in NVMe I/O thread on rank 1",
    }[kind]
