"""Several independent commands started at once, each waited for (and checked) by the test that reads it.

[Note: side by side] A test that runs a script the way a user does (``examples/train.py``, a benchmark) pays a
fresh interpreter importing torch, Lightning and Hydra, mostly one core's work. CI has two cores and runs pytest
in one process, so running such commands one after another leaves a core idle: a module fixture starts all of
its module's commands at once and each test waits only for its own, with the same assertions as before. Only
for commands that are independent of one another (own directories, own ports) and whose checks do not time
anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


class SideBySide:
    """Named commands, started in a session of their own when this is built; :meth:`get` waits for one."""

    def __init__(self, commands: Mapping[str, Sequence[str]], cwd: Mapping[str, Path] | Path,
                 env: Mapping[str, str], timeout: float) -> None:
        self.timeout = timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.done: dict[str, subprocess.CompletedProcess] = {}
        for name, cmd in commands.items():
            where = cwd[name] if isinstance(cwd, Mapping) else cwd
            self.procs[name] = subprocess.Popen(list(cmd), cwd=where, env=dict(env), stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def get(self, name: str) -> subprocess.CompletedProcess:
        """Command ``name``'s exit status and output once it has ended; an AssertionError with its output
        when it is still running ``timeout`` seconds after this call (its process group is killed)."""
        if name not in self.done:
            proc = self.procs[name]
            try:
                out, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
                out, err = proc.communicate()
                raise AssertionError(f"{name}: still running after {self.timeout} s\n{(out + err)[-3000:]}")
            self.done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.done[name]

    def close(self) -> None:
        """Kill whatever still runs (a test that failed before reading its command)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                _kill(proc)
                proc.communicate()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
