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

[Note: a dead store is a dead peer]
The store lives in one process: rank 0 under Lightning's launcher, SLURM or a manual launch (torchrun's
agent under torchrun). When that process dies (``kill -9``, the OOM killer, a lost node) the survivors'
store clients fail, and every further call to the store printed a C++ warning with its frames (twice a
second from the watchdog) while a fresh client retried its connection for 30 s, twice: 53 s and 1,615
lines for one dead rank. Now an unreachable store means a dead peer: the watchdog stops calling the
store at the first error (one warning from torch), waits ``lost_grace_s`` for the process to end by
itself (the main thread's next collective fails at once under gloo), then says so in one line and
exits 1. The main thread's own client is opened only after a plain socket probe of the store's
address (a refused or unanswered connection: no client, no retries, no C++ output), and a
communication error seen while the store is gone is reported in one line naming the dead host, not
as a traceback of gloo's "Connection closed by peer". At a normal end the store's host may exit
first while another rank is still finishing: the grace period (no output while it runs) covers
that, and teardown stops the watchdog.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from types import TracebackType
from typing import Callable, Iterator, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

_KEY = "lightning_zero/first_failure"

_PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker|communicator was aborted|remote process exited",
                        re.IGNORECASE)
"""Messages of the communication errors a dead peer causes (gloo, NCCL, the store's client)."""

STORE_TIMEOUT_S = 10.0
"""A store client's socket timeout: the longest a call to an unanswering (not refusing) host blocks."""


def store_address() -> Optional[str]:
    """``host:port`` of the job's rendezvous store, as the launcher exported it (None: not known)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else None


def store_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the store's address accepts a TCP connection: a plain socket probe, without torch's
    client (which retries a refused connection for its whole timeout, printing C++ frames)."""
    address = store_address()
    if address is None:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def looks_like_lost_peer(exc: BaseException) -> bool:
    """A communication error of the kind a dead peer causes (not an error of this rank's own: an
    ``OSError`` such as a data worker's broken pipe or a full disk is this process's own)."""
    return any(not isinstance(e, OSError) and (type(e).__name__ == "DistNetworkError" or _PEER_LOST.search(str(e)))
               for e in _chain(exc))


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: Optional[BaseException] = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _default_store() -> Optional[dist.Store]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no coordination: failures behave as without it
        return None


class OneLineError(RuntimeError):
    """An error whose message says everything (what went wrong, where, the fix): printed as one line,
    without a traceback, on every rank (a refusal, not a bug to debug)."""


class FailureBoard:
    """The store entry that says which rank failed first, and with what."""

    def __init__(self, store: Optional[dist.Store], rank: int, store_lost: bool = False) -> None:
        self.store = store
        self.rank = rank
        self.store_lost = store_lost
        """The store stopped answering: the process hosting it died ([Note: a dead store is a dead peer])."""

    @classmethod
    def for_default_group(cls, exc: Optional[BaseException] = None) -> "FailureBoard":
        """A board on a fresh client of the job's rendezvous store (the keys the watchdogs read); a
        board with ``store_lost`` set when the store's address no longer accepts connections. After
        an error a dead peer causes (``exc``), the probe is repeated for a second: a process killed a
        moment ago may close its gloo sockets before its listening one."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if _default_store() is None:
            return cls(None, rank)
        probes = 6 if exc is not None and looks_like_lost_peer(exc) else 1
        for i in range(probes):
            if not store_reachable():
                return cls(None, rank, store_lost=True)
            if i + 1 < probes:
                time.sleep(0.2)
        store = _own_client()
        return cls(store, rank, store_lost=store is None and store_address() is not None)

    def _lost(self) -> None:
        """Stop calling a store that failed once: every further call prints torch's C++ warning again."""
        self.store_lost = True
        self.store = None

    def lost_message(self) -> str:
        return (f"the job's rendezvous store ({store_address() or 'address unknown'}) stopped answering: the process "
                "hosting it (rank 0, or torchrun's agent) has died; its own output, if any, is above")

    def report(self, exc: BaseException) -> tuple[bool, str]:
        """Record this rank's failure; (whether it is the first, the first failure's description)."""
        mine = f"rank {self.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if self.store is None:
            return True, mine
        try:
            got = self.store.compare_set(_KEY, "", mine)
        except Exception:  # noqa: BLE001 - the store is gone (the job is ending): print_once decides
            self._lost()
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
        except Exception:  # noqa: BLE001 - the store's host died ([Note: a dead store is a dead peer])
            self._lost()
            return None
        return got.decode() if isinstance(got, bytes) else str(got)


def print_once(board: FailureBoard, exc: BaseException) -> None:
    """Let ``exc`` print in full only on the first failing rank; elsewhere one line (sys.excepthook).
    A communication error of the kind a dead peer causes is a consequence, never the news: one line
    that names the dead store's host, or says a peer died without reporting ([Note: a dead store is
    a dead peer]); gloo's frames inside an all-reduce say nothing about why the peer died."""
    first, description = board.report(exc)
    lost_peer = looks_like_lost_peer(exc)
    if lost_peer and board.store_lost:
        why = board.lost_message()
    elif lost_peer and first:  # the peer died without a word (SIGKILL, the OOM killer, a native crash)
        why = ("a peer process ended without reporting an error (killed, out of memory, or a crash in native code); "
               "the launcher's summary names it")
    elif first and isinstance(exc, OneLineError):
        why = ""
    elif first:
        return
    else:
        why = f"the first failure was {description}; its traceback is above"
    if isinstance(exc, OneLineError) and not why:  # a refusal: its whole message, in one line
        line = f"[rank {board.rank}] stopped: {type(exc).__name__}: {' '.join(str(exc).split())}"
    elif isinstance(exc, OneLineError) and description.split(": ")[1:2] == [type(exc).__name__]:
        line = f"[rank {board.rank}] stopped: {type(exc).__name__}, as {description.split(':')[0]} reported above"
    else:
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        line = f"[rank {board.rank}] stopped: {type(exc).__name__}: {text} ({why})"
    _set_line(exc, line)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        if value is exc:
            _write_line(line)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


_LINE_ATTR = "_lightning_zero_one_line"


def _write_line(line: str) -> None:
    """One write of the whole line (print writes the newline separately: another process's output
    sharing the stream could land in between)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _set_line(exc: BaseException, line: str) -> None:
    try:
        setattr(exc, _LINE_ATTR, line)
    except (AttributeError, TypeError):  # an exception type without a __dict__: the excepthook still prints it
        pass


def one_line(exc: BaseException) -> Optional[str]:
    """The one line ``print_once`` chose for ``exc`` (None: it is reported in full)."""
    return getattr(exc, _LINE_ATTR, None)


def _launch_rank() -> int:
    """This process's rank as its launcher exported it (torchrun: RANK; Lightning's re-launched
    processes: LOCAL_RANK and NODE_RANK; a plain start: 0), for errors before any process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ.get("LOCAL_RANK", "0")) + int(os.environ.get("NODE_RANK", "0")) * int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))


@contextmanager
def reported_once() -> Iterator[None]:
    """For entry points whose framework prints an escaping exception itself, before ``sys.excepthook``
    could (Hydra's ``@hydra.main`` prints the traceback on every rank, then exits 1): an error that
    ``print_once`` reduced to one line ends the process with that line and status 1; an error raised
    before any process group exists (a bad config, checked on every rank under torchrun) is reported
    in full by rank 0 and in one line by the others. Anything else propagates unchanged."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised unless it has its one line
        line = one_line(exc)
        rank = _launch_rank()
        if line is None and rank > 0 and not (dist.is_available() and dist.is_initialized()):
            text = str(exc).splitlines()[0][:300] if str(exc) else ""
            line = f"[rank {rank}] stopped: {type(exc).__name__}: {text} (rank 0 reports it in full)"
        if line is None:
            raise
        _write_line(line)
        raise SystemExit(1) from None


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
                 poll_s: float = 0.5, exit_fn: Callable[[int], None] = os._exit, lost_grace_s: float = 5.0) -> None:
        super().__init__(name="lz-peer-watchdog", daemon=True)
        self.exit_fn = exit_fn
        self.board = board
        self.cleanups = cleanups
        self.grace_s = grace_s
        self.lost_grace_s = lost_grace_s
        """How long a process may go on once the store is gone (its main thread's next collective
        normally fails at once; a normal end may see the store's host exit first)."""
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
            if self.board.store_lost:  # [Note: a dead store is a dead peer]: quiet while the grace runs
                if self._halt.wait(self.lost_grace_s) or self.own_failure:
                    return  # ended by itself (a normal end, or the main thread's own error path)
                print(f"[rank {self.board.rank}] stopping: {self.board.lost_message()}", file=sys.stderr, flush=True)
                self._end()
                return
            if first is None or first == seen or self.own_failure:
                continue
            print(f"[rank {self.board.rank}] stopping: {first}", file=sys.stderr, flush=True)
            if self._halt.wait(self.grace_s):
                return  # the process ended its fit by itself (the launcher, or a collective error)
            self._end()
            return

    def _end(self) -> None:
        """The strategy's cleanups (no collective), then the process ends with status 1."""
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                log.error("cleanup after a peer's failure failed: %s", e)
        sys.stderr.flush()
        self.exit_fn(1)


def _own_client() -> Optional[dist.Store]:
    """A connection of the watchdog's own to the rendezvous store: a store client is not shared with
    the main thread, which uses the default one (process groups are created through it)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or _default_store() is None:
        return None
    try:
        from datetime import timedelta

        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                             wait_for_workers=False)
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
    store = _own_client() if store_reachable() else None
    if store is None:
        return None
    board = FailureBoard(store, dist.get_rank())
    dog = PeerWatchdog(board, cleanups)
    _RUNNING.add(dog)
    dog.start()
    return dog


__all__ = ["FailureBoard", "OneLineError", "PeerWatchdog", "hold_sigterm", "looks_like_lost_peer", "one_line",
           "print_once", "reported_once", "start_watchdog", "store_reachable"]

