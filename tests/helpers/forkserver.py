"""Ranks forked from a process that has already imported torch, Lightning and lightning_zero.

[Note: forked ranks]
A rank started as a fresh ``python -m tests.helpers.run_scenario`` spends its first ~7 s importing torch,
Lightning (which pulls in ``torch._dynamo`` and, through torchmetrics, transformers) and lightning_zero. On the
2-core CI machine that is ~8 s of every 2-rank launch and ~16 s of every 4-rank one, before the scenario runs,
and the suite makes a few hundred launches. So one-node launches on the CPU fork their ranks from a *zygote*: a
process started once per launch environment that has done those imports (and each suite's ``scenarios`` module,
the first time a launch names it) and then only forks. A forked rank is the process the fresh interpreter would
be, minus the imports:

* the same interpreter, working directory and ``sys.path`` (the zygote is ``python -m`` of this module from the
  repository root with the launch's ``PYTHONPATH``); the entry runs as ``__main__`` through ``runpy`` with the
  entry's ``sys.argv``, and the process ends through the interpreter's normal exit (exit code, ``sys.excepthook``,
  atexit, non-daemon threads), because the child returns out of the zygote's loop before it runs anything;
* the environment: the zygote is started with the launch's environment, so whatever a module reads from it at
  import (``HF_HUB_OFFLINE``, ``OMP_NUM_THREADS``) is what a fresh rank would read; one zygote per distinct
  environment. The rank's own variables (``RANK``, ``MASTER_PORT``, ...) are set in the child before the entry
  runs; torch.distributed and Lightning read them when the scenario starts;
* fork safety: the zygote forks only while it has one thread (``/proc/self/task``; ``OMP_NUM_THREADS=1`` keeps
  torch's pools unstarted) and has touched neither CUDA nor a process group; otherwise it refuses, and the
  launch starts fresh interpreters as before;
* output, stdin, process group: the child appends to the launch's log (the ranks share it, in arrival order,
  as with the shared file of the fresh launch), reads ``/dev/null``, closes the zygote's pipes, and joins rank 0's
  process group, so the harness's ``killpg`` reaches every rank as before.

Not forked (:func:`forkable`): launches that see a GPU (``LZ_TEST_ACCELERATOR=gpu``, or ``CUDA_VISIBLE_DEVICES`` not
empty: CUDA after fork), environments the C
library reads at process start (``MALLOC_*``), multi-node and torchrun launches, and ``LZ_TEST_FORK=0``.

Protocol (one JSON object a line): the harness writes ``{"id", "argv", "env", "log", "pgid", "preload"}`` to the
zygote's stdin; the zygote answers on its stdout ``{"id", "pid"}`` (or ``{"id", "refused": why}``) and, whenever it
reaps a child, ``{"exit": pid, "code": c}`` (``-signal`` when a signal ended it, as ``Popen.returncode``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Optional

from tests.helpers.launch import ACCELERATOR_ENV, ROOT

PRELOAD = ("torch", "lightning.pytorch", "lightning_zero", "tests.helpers.harness")
"""What the zygote imports before its first fork; a launch's suite module comes on top, on first use."""
EXEC_ONLY_ENV_PREFIXES = ("MALLOC_", "LD_", "PYTHONMALLOC", "PYTHONHASHSEED")
"""Variables read when a process starts (the C library, the loader, the interpreter): a launch that sets one of
them differently from the pytest process starts fresh interpreters."""
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
"""Variables that change from test to test and that nothing reads at import: not part of a zygote's key (the
forked rank gets the launch's own value)."""
MAX_ZYGOTES = 2
"""Live zygotes at once (each holds ~0.4 GB of imports); the least recently used one is stopped first."""
REPLY_TIMEOUT_S = 300.0
"""How long a launch waits for the zygote to fork a rank (its first request imports everything)."""


def forkable(env: Mapping[str, str], nodes: int, launcher: str) -> bool:
    """Whether a launch's ranks may be forked from a zygote ([Note: forked ranks])."""
    if os.environ.get("LZ_TEST_FORK", "1") == "0" or os.environ.get("LZ_TEST_TORCHRUN"):
        return False
    if launcher != "direct" or nodes != 1 or not sys.platform.startswith("linux"):
        return False
    if env.get(ACCELERATOR_ENV, "cpu") == "gpu" or env.get("CUDA_VISIBLE_DEVICES") != "":  # the GPUs are hidden
        return False
    return not any(k.startswith(EXEC_ONLY_ENV_PREFIXES) and os.environ.get(k) != v for k, v in env.items())


# ------------------------------------------------------------------ the harness's side
class ForkedRank:
    """A forked rank as the harness polls it: the parts of ``subprocess.Popen`` that ``_run_ranks`` uses."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self.zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
        self.returncode = code
        return code


class Zygote:
    """One zygote process (its environment fixed at start) and the reader of its answers."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], cwd=ROOT, env=dict(env), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self._replies[int(msg["id"])] = msg
                self._cond.notify_all()
        with self._cond:  # the zygote is gone: nobody will reap or answer any more
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, argv: list[str], env: Mapping[str, str], log: Path, pgid: int, preload: str) -> Optional[ForkedRank]:
        """A rank forked with ``env`` writing to ``log`` in process group ``pgid`` (0: a new one it leads), or None
        when the zygote refuses or is gone (the caller then starts a fresh interpreter)."""
        with self._cond:
            self._next_id += 1
            rid = self._next_id
        req = {"id": rid, "argv": argv, "env": dict(env), "log": str(log), "pgid": pgid, "preload": preload}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        with self._cond:
            self._cond.wait_for(lambda: rid in self._replies or not self.alive, timeout=REPLY_TIMEOUT_S)
            reply = self._replies.pop(rid, None)
        if reply is None or "pid" not in reply:
            return None
        return ForkedRank(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> Optional[int]:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
        if not self.alive and not _exists(pid):  # reaped by nobody we can hear from: it is gone
            return -9
        return None

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or not self.alive, timeout=timeout)
        return self.exit_code(pid)

    def close(self) -> None:
        if self.alive:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the zygote exits at EOF
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Zygotes:
    """The zygotes of this pytest process, one per launch environment, at most :data:`MAX_ZYGOTES` alive."""

    def __init__(self) -> None:
        self._by_env: dict[frozenset, Zygote] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def get(self, env: Mapping[str, str]) -> Zygote:
        env = {k: v for k, v in env.items() if k not in VOLATILE_ENV}
        key = frozenset(env.items())
        with self._lock:
            zygote = self._by_env.pop(key, None)
            if zygote is None or not zygote.alive:
                zygote = Zygote(env)
            self._by_env[key] = zygote  # most recently used last
            while len(self._by_env) > MAX_ZYGOTES:
                oldest = next(iter(self._by_env))
                self._by_env.pop(oldest).close()
            return zygote

    def close(self) -> None:
        with self._lock:
            for zygote in self._by_env.values():
                zygote.close()
            self._by_env.clear()


# ------------------------------------------------------------------ the zygote's side
def _single_threaded() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def _cuda_touched() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _serve(requests: int, answers: int) -> Optional[dict[str, Any]]:
    """The zygote's loop: fork a rank per request and report reaped children. Returns (in the child only) the
    request the child is to run; returns None in the zygote at EOF, once its children are reaped."""
    buf = b""
    live: set[int] = set()
    eof = False

    def answer(msg: dict[str, Any]) -> None:
        os.write(answers, (json.dumps(msg) + "\n").encode())

    while not eof or live:
        ready, _, _ = select.select([] if eof else [requests], [], [], 0.05)
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
            answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:
            eof = True
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if req.get("preload"):
                try:
                    importlib.import_module(req["preload"])
                except Exception:  # noqa: BLE001 - the rank imports it again and reports the error itself
                    pass
            if not _single_threaded() or _cuda_touched():
                answer({"id": req["id"], "refused": "the zygote has threads or CUDA state; not forking"})
                continue
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(answers)
                return req
            live.add(pid)
            answer({"id": req["id"], "pid": pid})
    return None


def _become_rank(req: dict[str, Any]) -> None:
    """In the forked child: the rank's process group, output and environment, then the entry as ``__main__``
    (stdin is already ``/dev/null``: :func:`main`)."""
    import runpy

    os.setpgid(0, int(req["pgid"]))
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(req["env"])
    from tests.helpers.harness import ENTRY

    sys.argv = [ENTRY, *req["argv"]]
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)


def main() -> None:
    """The zygote: import, then serve forks until the harness closes stdin."""
    answers = os.dup(1)  # the protocol's own descriptors: nothing the imports print or read can reach them
    requests = os.dup(0)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name in PRELOAD:
        importlib.import_module(name)
    req = _serve(requests, answers)
    if req is not None:
        _become_rank(req)


if __name__ == "__main__":
    main()
