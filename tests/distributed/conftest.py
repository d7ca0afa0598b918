"""Fixtures shared by the parity suites of this directory (test_zero_stages.py, test_zero3.py).

[Note: one 3-rank launch] The uneven-partition checks of stages 1/2 and stage 3's 3-rank parity and memory
checks read one launch of 3 gloo ranks with one ``ddp`` reference (was one launch per module): a launch
costs three fresh interpreters importing Lightning on CI's 2 cores, more than the runs it holds. The runs
train 10 steps (2 accumulated micro-batches each, clipped, validated every 10 batches, through ParityNet's
LR warm-up into its decay): a wrong update misses the 1e-4 parity at its first step, and uneven partitions
(ParityNet's sizes do not divide by 3) are exercised by every step alike.
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import run_worker

THREE_RANK_STEPS = 10


@pytest.fixture(scope="session")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """``ddp``, ``zero1``, ``zero2`` and ``zero3`` on 3 ranks, :data:`THREE_RANK_STEPS` steps each."""
    runs = {name: f"{name}:steps={THREE_RANK_STEPS}" for name in ("ddp", "zero1", "zero2", "zero3")}
    return run_worker(tmp_path_factory.mktemp("three_ranks"), 3, runs, timeout=1200)
