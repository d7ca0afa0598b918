"""Launch scenario ``faults.plan`` (tests/faults/fault_runs.py) through the harness (tests/helpers/harness.py:
``start_scenario``) on 2 CPU/gloo ranks, under torchrun or Lightning's own launcher, with a hard wall-clock limit,
and collect how every process ended.

Nothing here raises on a failed, killed or hanging worker: the launcher runs in a session of its own and
is killed (its process group, then every worker pid the workers wrote) when the limit is reached; the
tests assert on the returned :class:`FaultRun`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tests.helpers.harness import start_scenario

LAUNCHERS = {"torchrun": "torchrun", "lightning": "python"}
"""This suite's launcher names -> the harness's (``python``: one process, Lightning's launcher starts rank 1)."""
LIMIT_S = 60.0
"""Every process of a failing job must be gone this long after the fault fired."""
STARTUP_LIMIT_S = 180.0
"""From the launch until the fault (imports of torch and Lightning on a loaded 2-core machine take tens
of seconds); a run that never reaches its fault is killed then."""
NPROC = 2


@dataclass
class FaultRun:
    launcher: str
    out: Path
    log: str = ""
    returncode: Optional[int] = None
    timed_out: bool = False
    seconds: float = 0.0
    """Launch until the launcher exited and every worker pid was gone (or the limit)."""
    fault: Optional[dict[str, Any]] = None
    """The worker's ``fault_time`` record (time, what, rank), when a fault fired."""
    after_fault: Optional[float] = None
    """Seconds from the fault until the launcher and every worker were gone (or killed at the limit)."""
    pids: dict[int, int] = field(default_factory=dict)
    left_alive: dict[int, int] = field(default_factory=dict)
    """Worker processes (rank -> pid) still running when the launcher had exited and the limit was up."""
    reports: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    atexit: dict[int, bool] = field(default_factory=dict)
    swap_files: list[str] = field(default_factory=list)
    swap_dirs: list[str] = field(default_factory=list)

    def lines(self, rank: Optional[int] = None) -> list[str]:
        """Output lines of ``rank`` (its ``[rR] `` prefix removed); ``None``: untagged lines (torchrun's
        agent, Lightning's launcher before the tags exist, C++ writes to fd 2). Under torchrun, torch's
        excepthook prefixes each traceback line with ``[rankN]: ``; that is removed too."""
        got = []
        for line in self.log.splitlines():
            m = re.match(r"\[r(\d+)\] ?(?:\[rank\d+\]: ?)?(.*)$", line)  # and torch's own "[rankN]: " prefix
            if rank is None and m is None:
                got.append(line)
            elif m is not None and rank is not None and int(m.group(1)) == rank:
                got.append(m.group(2))
        return got

    def tail(self, n: int = 6000) -> str:
        return self.log[-n:]

    def exit_codes(self) -> dict[int, Any]:
        """Each rank's exit status as far as it can be known:

        * torchrun: the ``exitcode`` its failure summary gives per rank (a rank it does not list exited 0);
        * Lightning's launcher: rank 0 is the launched process (``returncode``); rank 1 (a process
          Lightning started) is ``1`` when its fit raised and its interpreter reached ``atexit`` (an
          uncaught exception exits 1), ``0`` when its fit returned and it reached ``atexit``, else
          ``"killed"`` (it never finished: a signal ended it, which is a non-zero status).
        """
        codes: dict[int, Any] = {}
        if self.launcher == "torchrun":
            for m in re.finditer(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", self.log):
                codes[int(m.group(1))] = int(m.group(2))
            if self.returncode == 0 or not self.timed_out:
                for r in range(NPROC):
                    codes.setdefault(r, 0 if r not in self.left_alive else "running")
            return codes
        codes[0] = self.returncode
        for r in range(1, NPROC):
            reps = [rep[r] for rep in self.reports.values() if r in rep]
            if self.atexit.get(r):
                codes[r] = 1 if any(rep.get("exc_type") for rep in reps) else 0
            else:
                codes[r] = "running" if r in self.left_alive else "killed"
        return codes


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def launch(out: Path, plan: list[dict[str, Any]], launcher: str, limit: float = LIMIT_S,
           startup_limit: float = STARTUP_LIMIT_S) -> FaultRun:
    """Run the plan; every process must be gone ``limit`` seconds after the injected fault fired
    (``OUT/fault_time``, written by the worker), or ``startup_limit`` after the launch when no fault
    fired (a run without a fault, or one that never reached it). Past that, everything is killed."""
    out.mkdir(parents=True, exist_ok=True)
    if launcher not in LAUNCHERS:
        raise ValueError(launcher)
    run = FaultRun(launcher, out)
    log_path = out / "output.log"
    started_wall, started = time.time(), time.monotonic()
    marker = out / "fault_time"

    def deadline() -> float:
        if marker.exists():
            try:
                return started + (json.loads(marker.read_text())["time"] - started_wall) + limit
            except (ValueError, KeyError):
                pass
        return started + startup_limit

    def pids() -> dict[int, int]:
        got = {}
        for r in range(NPROC):
            p = out / f"pid.rank{r}"
            try:
                got[r] = int(p.read_text())
            except (OSError, ValueError):
                pass
        return got

    with open(log_path, "w") as log_file:
        proc = start_scenario("faults.plan", NPROC, {"plan": plan}, out, launcher=LAUNCHERS[launcher],
                              env={"CUDA_VISIBLE_DEVICES": ""}, stdout=log_file)
        # the launcher and, since torchrun starts its workers in sessions of their own, every worker pid
        while (proc.poll() is None or any(_alive(pid) for pid in pids().values())) and time.monotonic() < deadline():
            time.sleep(0.1)
        run.seconds = time.monotonic() - started
        if proc.poll() is None:
            run.timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    run.returncode = proc.returncode
    run.pids = pids()
    for r, pid in run.pids.items():
        if _alive(pid):
            run.left_alive[r] = pid
            run.timed_out = True
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if marker.exists():
        fault = json.loads(marker.read_text())
        run.fault = fault
        run.after_fault = run.seconds - (fault["time"] - started_wall)
    run.log = log_path.read_text(errors="replace")
    for step in plan:
        per_rank = {}
        for r in range(NPROC):
            p = out / f"{step['name']}.rank{r}.json"
            if p.exists():
                per_rank[r] = json.loads(p.read_text())
        run.reports[step["name"]] = per_rank
    run.atexit = {r: (out / f"atexit.rank{r}").exists() for r in range(NPROC)}
    nvme = out / "nvme"
    if nvme.is_dir():
        run.swap_files = sorted(str(p.relative_to(nvme)) for p in nvme.rglob("*.swap"))
        root = nvme / "lightning_zero_swap"
        run.swap_dirs = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    (out / "run_summary.json").write_text(json.dumps({  # for a person reading a CI failure
        "launcher": launcher, "returncode": run.returncode, "timed_out": run.timed_out, "seconds": run.seconds,
        "after_fault": run.after_fault, "fault": run.fault,
        "exit_codes": {str(k): v for k, v in run.exit_codes().items()},
        "left_alive": run.left_alive, "swap_files": run.swap_files, "swap_dirs": run.swap_dirs, "atexit": run.atexit,
        "full_tracebacks": all_full_reports(run),
        "nondaemon_threads": {n: {r: rep.get("nondaemon_threads") for r, rep in reps.items()}
                              for n, reps in run.reports.items()},
    }, indent=1))
    return run


# ------------------------------------------------------------------------------------------ reading output
def traceback_reports(lines: list[str]) -> list[list[str]]:
    """Full traceback reports in one rank's output lines: each is the list of exception lines
    (``Type: message``) of one printed chain (``Traceback ...`` blocks joined by "During handling of the
    above exception ..." / "The above exception was the direct cause ...")."""
    chain = ("During handling of the above exception", "The above exception was the direct cause")
    reports: list[list[str]] = []
    cur: Optional[list[str]] = None
    state, linked = "out", False
    for line in lines:
        if line.startswith("Traceback (most recent call last):"):
            if not (state == "chain" and linked):
                if cur:
                    reports.append(cur)
                cur = []
            state, linked = "frames", False
            continue
        if state == "frames":
            if line.startswith((" ", "\t")) or not line.strip():
                continue
            assert cur is not None
            cur.append(line)  # the exception line ends the block
            state = "chain"
            continue
        if state == "chain":
            if not line.strip():
                continue
            if line.startswith(chain):
                linked = True
                continue
            if cur:
                reports.append(cur)
            cur, state, linked = None, "out", False
    if cur:
        reports.append(cur)
    return reports


def full_reports_with(run: FaultRun, message: str) -> dict[str, int]:
    """Per output source (``r0``, ``r1``, ``launcher``): how many full traceback reports contain ``message``
    in one of their exception lines."""
    counts = {}
    for src, rank in [(f"r{r}", r) for r in range(NPROC)] + [("launcher", None)]:
        counts[src] = sum(1 for rep in traceback_reports(run.lines(rank)) if any(message in ln for ln in rep))
    return counts


def all_full_reports(run: FaultRun) -> dict[str, int]:
    """Per source: every full traceback report, whatever its message."""
    return {src: len(traceback_reports(run.lines(rank)))
            for src, rank in [(f"r{r}", r) for r in range(NPROC)] + [("launcher", None)]}


def summary(run: FaultRun) -> str:
    """One paragraph for assertion messages."""
    after = f"{run.after_fault:.1f}" if run.after_fault is not None else None
    return (f"launcher={run.launcher} returncode={run.returncode} timed_out={run.timed_out} seconds={run.seconds:.1f} "
            f"after_fault={after} fault={run.fault} "
            f"exit_codes={run.exit_codes()} left_alive={run.left_alive} swap_files={run.swap_files} "
            f"atexit={run.atexit}\n--- output tail ---\n{run.tail()}")
