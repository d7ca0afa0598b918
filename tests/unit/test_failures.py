"""failures.py [Note: failing once]: one rank reports in full, the others in one line, and a rank
whose peer failed is ended after a grace period (the store is a torch HashStore here; the
multi-process behaviour is in tests/faults)."""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from lightning_zero.failures import FailureBoard, PeerWatchdog, print_once


def test_exactly_one_rank_is_first() -> None:
    store = dist.HashStore()
    a, b = FailureBoard(store, 0), FailureBoard(store, 1)
    assert a.first_failure() is None
    first_b, desc_b = b.report(ValueError("bad lr"))
    first_a, desc_a = a.report(ValueError("bad lr"))
    assert first_b and not first_a
    assert desc_a == desc_b == "rank 1: ValueError: bad lr" == a.first_failure()


def test_later_failures_print_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    store = dist.HashStore()
    FailureBoard(store, 0).report(RuntimeError("boom"))
    exc = RuntimeError("connection closed")
    saved = sys.excepthook
    try:
        print_once(FailureBoard(store, 1), exc)
        assert sys.excepthook is not saved
        sys.excepthook(RuntimeError, exc, None)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "[rank 1] stopped: RuntimeError: connection closed" in err
        assert "rank 0: RuntimeError: boom" in err
    finally:
        sys.excepthook = saved


def test_watchdog_ends_a_rank_whose_peer_failed_after_the_grace_period() -> None:
    store = dist.HashStore()
    exits, cleaned = [], []
    dog = PeerWatchdog(FailureBoard(store, 0), [lambda: cleaned.append(1)], grace_s=0.2, poll_s=0.02,
                       exit_fn=exits.append)
    dog.start()
    time.sleep(0.1)
    assert not exits  # nothing failed yet
    FailureBoard(store, 1).report(RuntimeError("boom"))
    dog.join(timeout=5)
    assert exits == [1] and cleaned == [1]


def test_watchdog_leaves_alone_a_rank_that_fails_itself_or_ends() -> None:
    store = dist.HashStore()
    exits: list = []
    own = PeerWatchdog(FailureBoard(store, 0), [], grace_s=0.1, poll_s=0.02, exit_fn=exits.append)
    own.own_failure = True
    own.start()
    ended = PeerWatchdog(FailureBoard(store, 1), [], grace_s=2.0, poll_s=0.02, exit_fn=exits.append)
    ended.start()
    FailureBoard(store, 0).report(RuntimeError("boom"))
    time.sleep(0.3)
    ended.stop()  # the fit ended by itself within the grace period (teardown stops the watchdog)
    own.stop()
    own.join(timeout=5)
    ended.join(timeout=5)
    assert exits == []
