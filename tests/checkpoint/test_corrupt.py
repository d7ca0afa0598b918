"""A damaged shard is detected on load, on every rank, without a hang (issue #13).

Copies of the reference's step-3 checkpoint (2 ranks, zero3): one with 64 bytes inverted in the middle
of ``__1_0.distcp``, one with ``__0_0.distcp`` cut to half its size. Resuming each on 3 ranks (zero2)
must raise ``lightning_zero.checkpoint.CorruptCheckpointError`` whose message names the damaged file,
on every rank (also on ranks that read no byte of that file); the launch has a timeout and collectives
time out after 60 s, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import pytest

from tests.checkpoint.conftest import CORRUPT


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_damaged_shard_raises_corrupt_checkpoint_error_on_every_rank(three_ranks, kind: str) -> None:
    ranks = three_ranks.ranks(f"corrupt_{kind}")  # fails (with the log) if a rank hung or died
    assert not three_ranks.timed_out
    victim = CORRUPT[kind]
    for r in ranks:
        assert r["error"], f"rank {r['rank']} loaded a damaged checkpoint without an error"
        assert r["exc_corrupt"], (r["rank"], r["exc_type"], r["error"][-3000:])
        assert victim in r["exc_msg"], (r["rank"], r["exc_msg"])
        assert not r["losses"], "training ran on a damaged checkpoint"
