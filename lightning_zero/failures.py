"""When one rank fails: one full report, one line from every other rank, and no rank left hanging.

[Note: failing once]
Ranks share the rendezvous store (torch.distributed's TCPStore; no collective, so it works while
collectives are stuck). The first rank whose exception reaches ``ZeroStrategy.on_exception`` records
itself there (``compare_set``: exactly one wins) and its traceback prints as usual. A rank that
fails afterwards (the same bad option on every rank, or a collective broken by the first failure)
prints one line naming the first failure instead of a second copy of it.

A rank that did not fail may be blocked in a collective waiting for the failed one, possibly for
the whole collective timeout, under launchers that do not kill the job when one process exits
(``srun``, a manual launch; torchrun and Lightning's own launcher do). :class:`PeerWatchdog`, a
daemon thread polling the store every half second, sees the failure, says so in one line, waits a
grace period for the process to end by itself, then runs the strategy's cleanup callbacks (NVMe
swap directories) and exits with status 1.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from types import TracebackType
from typing import Callable, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

_KEY = "lightning_zero/first_failure"


def _default_store() -> Optional[dist.Store]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no coordination: failures behave as without it
        return None


class FailureBoard:
    """The store entry that says which rank failed first, and with what."""

    def __init__(self, store: Optional[dist.Store], rank: int) -> None:
        self.store = store
        self.rank = rank

    @classmethod
    def for_default_group(cls) -> "FailureBoard":
        """A board on a fresh client of the job's rendezvous store (the keys the watchdogs read)."""
        return cls(_own_client(), dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)

    def report(self, exc: BaseException) -> tuple[bool, str]:
        """Record this rank's failure; (whether it is the first, the first failure's description)."""
        mine = f"rank {self.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if self.store is None:
            return True, mine
        try:
            got = self.store.compare_set(_KEY, "", mine)
        except Exception:  # noqa: BLE001 - the store is gone (the job is ending): report in full
            return True, mine
        first = got.decode() if isinstance(got, bytes) else str(got)
        return first == mine, first

    def release(self) -> None:
        """Drop the store client now, in an ordinary call, rather than whenever the board is collected:
        a c10d store client destroyed while the interpreter finalises can abort the process ("terminate
        called without an active exception", seen at the exit of multi-fit gloo workers)."""
        self.store = None

    def first_failure(self) -> Optional[str]:
        """The first failure, if any rank reported one (never blocks)."""
        if self.store is None:
            return None
        try:
            if not self.store.check([_KEY]):
                return None
            got = self.store.get(_KEY)
        except Exception:  # noqa: BLE001
            return None
        return got.decode() if isinstance(got, bytes) else str(got)


def print_once(board: FailureBoard, exc: BaseException) -> None:
    """Let ``exc`` print in full only on the first failing rank; elsewhere one line (sys.excepthook)."""
    first, description = board.report(exc)
    if first:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        if value is exc:
            print(f"[rank {board.rank}] stopped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                  f"(the first failure was {description}; its traceback is above)", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def hold_sigterm() -> None:
    """While a failed rank cleans up (on_exception to teardown), a launcher's SIGTERM must not cut
    it short: Lightning's own SIGTERM handler broadcasts to the peers (raising, since one is gone)
    inside whatever runs, e.g. the removal of NVMe swap files. The signal is noted and ignored; the
    process exits with the original error right after, and Lightning's signal connector restores the
    previous handlers at the end of teardown."""
    if threading.current_thread() is not threading.main_thread():
        return

    def noted(signum: int, frame: object) -> None:
        print("[lightning_zero] SIGTERM received while cleaning up after a failure; exiting once done",
              file=sys.stderr, flush=True)

    try:
        signal.signal(signal.SIGTERM, noted)
    except (ValueError, OSError):  # not settable here (embedded interpreters)
        pass


class PeerWatchdog(threading.Thread):
    """Ends this process when another rank failed and this one did not end within ``grace_s``."""

    def __init__(self, board: FailureBoard, cleanups: list[Callable[[], None]], grace_s: float = 10.0,
                 poll_s: float = 0.5, exit_fn: Callable[[int], None] = os._exit) -> None:
        super().__init__(name="lz-peer-watchdog", daemon=True)
        self.exit_fn = exit_fn
        self.board = board
        self.cleanups = cleanups
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._halt = threading.Event()
        self.own_failure = False
        """Set by on_exception: this rank is failing itself and ends through the normal path."""

    def stop(self) -> None:
        self._halt.set()
        _RUNNING.discard(self)

    def run(self) -> None:
        try:
            self._watch()
        finally:
            self.board.release()  # the thread ends (stopped at teardown, or exiting): its client goes with it

    def _watch(self) -> None:
        seen = self.board.first_failure()  # an earlier fit's failure in this job is not news
        while not self._halt.wait(self.poll_s):
            first = self.board.first_failure()
            if first is None or first == seen or self.own_failure:
                continue
            print(f"[rank {self.board.rank}] stopping: {first}", file=sys.stderr, flush=True)
            if self._halt.wait(self.grace_s):
                return  # the process ended its fit by itself (the launcher, or a collective error)
            for cleanup in self.cleanups:
                try:
                    cleanup()
                except Exception as e:  # noqa: BLE001 - best effort on the way out
                    log.error("cleanup after a peer's failure failed: %s", e)
            sys.stderr.flush()
            self.exit_fn(1)
            return


def _own_client() -> Optional[dist.Store]:
    """A connection of the watchdog's own to the rendezvous store: a store client is not shared with
    the main thread, which uses the default one (process groups are created through it)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or _default_store() is None:
        return None
    try:
        from datetime import timedelta

        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no watchdog then; failures still end through the launcher
        return None


_RUNNING: "set[PeerWatchdog]" = set()
"""Watchdogs alive in this process, stopped and joined at exit (a thread inside a store call while
the interpreter finalises aborts the process)."""


def _join_all() -> None:
    for dog in list(_RUNNING):
        dog.stop()
        dog.join(timeout=5.0)


atexit.register(_join_all)


def start_watchdog(cleanups: list[Callable[[], None]]) -> Optional[PeerWatchdog]:
    store = _own_client()
    if store is None:
        return None
    board = FailureBoard(store, dist.get_rank())
    dog = PeerWatchdog(board, cleanups)
    _RUNNING.add(dog)
    dog.start()
    return dog


__all__ = ["FailureBoard", "PeerWatchdog", "hold_sigterm", "print_once", "start_watchdog"]

