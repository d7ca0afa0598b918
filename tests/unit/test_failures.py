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


def test_a_lost_peer_is_one_line_naming_the_dead_store(capsys) -> None:  # type: ignore[no-untyped-def]
    """[Note: a dead store is a dead peer]: gloo's error after the store's host died prints one line."""
    exc = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically caused by ...")
    saved = sys.excepthook
    try:
        print_once(FailureBoard(None, 1, store_lost=True), exc)
        sys.excepthook(RuntimeError, exc, None)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "[rank 1] stopped: RuntimeError:" in err and "rendezvous store" in err
        own = ValueError("bad lr")  # an error of this rank's own still prints in full
        print_once(FailureBoard(None, 1, store_lost=True), own)
        assert sys.excepthook(ValueError, own, None) is None and "stopped" not in capsys.readouterr().err
    finally:
        sys.excepthook = saved


class _DeadStore:
    def __init__(self) -> None:
        self.calls = 0

    def check(self, keys: list) -> bool:
        self.calls += 1
        raise RuntimeError("recvValue failed: Connection was likely closed")


def test_watchdog_treats_an_unreachable_store_as_a_dead_peer(capsys) -> None:  # type: ignore[no-untyped-def]
    store, exits = _DeadStore(), []
    dog = PeerWatchdog(FailureBoard(store, 1), [], poll_s=0.02, lost_grace_s=0.2, exit_fn=exits.append)  # type: ignore[arg-type]
    dog.start()
    dog.join(timeout=5)
    assert exits == [1] and store.calls == 1  # the store is called once, never again (each call prints C++ frames)
    assert "rendezvous store" in capsys.readouterr().err


def test_watchdog_lets_a_normal_end_finish_when_the_store_goes_first(capsys) -> None:  # type: ignore[no-untyped-def]
    exits: list = []
    dog = PeerWatchdog(FailureBoard(_DeadStore(), 1), [], poll_s=0.02, lost_grace_s=2.0, exit_fn=exits.append)  # type: ignore[arg-type]
    dog.start()
    time.sleep(0.3)
    dog.stop()  # teardown within the grace period
    dog.join(timeout=5)
    assert exits == [] and capsys.readouterr().err == ""


def test_only_communication_errors_count_as_a_lost_peer() -> None:
    from lightning_zero.failures import looks_like_lost_peer

    assert looks_like_lost_peer(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert looks_like_lost_peer(RuntimeError("[pair.cc:537] Read error [::1]:2: Connection reset by peer"))
    assert not looks_like_lost_peer(BrokenPipeError(32, "Broken pipe"))  # a data worker's pipe: this rank's own
    assert not looks_like_lost_peer(ValueError("Invalid learning rate: -1.0"))
