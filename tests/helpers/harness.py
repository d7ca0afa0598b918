"""The distributed-test harness: launch N gloo ranks, run a named scenario on each, collect per-rank records.

Every multi-process suite (parity, checkpoint, zoo, parallel, ...) goes through this one path instead of a
worker script and a launcher of its own, each with its own argument protocol. A suite keeps its scenarios in
``tests/<suite>/scenarios.py`` (which may import sibling modules that register more); a test names one.

Usage::

    # tests/mysuite/scenarios.py
    from tests.helpers.harness import ScenarioContext, scenario

    @scenario("mysuite.train")
    def train(ctx: ScenarioContext) -> dict:
        losses = fit(steps=ctx.params["steps"])          # every rank runs this, torch.distributed is yours
        ctx.record("after_fit", {"losses": losses})      # OUT/after_fit.rank<r>.pt, at once (survives a later crash)
        return {"rank": ctx.rank, "losses": losses}      # recorded as "result"

    # tests/mysuite/test_train.py
    from tests.helpers.harness import run_scenario

    def test_train(tmp_path):
        run = run_scenario("mysuite.train", nprocs=2, params={"steps": 3}, out=tmp_path, timeout=300).check()
        rank0, rank1 = run.ranks("result")

How it runs: ``python -m tests.helpers.run_scenario NAME PARAMS OUT`` on each of N ranks, from the repository root,
with torchrun's environment but not its agent ([Note: ranks without torchrun's agent]; ``nodes > 1``: one
``torchrun --nproc-per-node N`` per simulated node over a shared static rendezvous;
:func:`start_scenario` with ``launcher="python"``: one process, Lightning's own launcher starts the others). The
parameters travel as one JSON file; each rank writes its records with ``torch.save`` (tensors allowed) through a
temporary file and a rename, so a reader never sees half a record. The scenario ``NAME`` is ``<suite>.<what>``:
the entry imports ``tests.<suite>.scenarios`` and calls the function registered under that name.

[Note: what the harness guarantees]
- The workers' environment is :func:`tests.helpers.launch.worker_env` (one thread per rank, warnings off,
  ``LZ_TEST_ACCELERATOR=gpu`` keeps the GPUs visible, otherwise they are hidden) without what an in-process
  Lightning run earlier in the pytest process leaves behind (``LAUNCHER_ENV``, ``PL_*``), with ``PYTHONPATH`` on
  the repository and ``env`` on top (``env={"CUDA_VISIBLE_DEVICES": ""}`` pins a suite to the CPU).
- The launch runs in a session of its own; on a timeout the whole tree is SIGKILLed and the run says
  ``timed_out`` (no test can hang CI). Records written before a failure, a kill or a timeout are still loaded, so
  a suite that reports each missing record with the log (zoo, checkpoint) keeps doing so.
- Process-group timeouts, fault injection and anything else a scenario does inside its ranks is the
  scenario's own business: the harness adds nothing between torchrun and the scenario function.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from tests.helpers.launch import LAUNCHER_ENV, ROOT, free_port, skip_without_gpus, worker_env
from tests.helpers.worker_io import save_atomic

ENTRY = "tests.helpers.run_scenario"
"""The one worker entry every launch runs (``python -m``)."""

_SCENARIOS: dict[str, Callable[["ScenarioContext"], Any]] = {}
"""Name -> scenario function, filled by :func:`scenario` when a suite's scenarios module is imported (in the
worker processes only: a test names a scenario by string and imports nothing of it)."""


def scenario(name: str) -> Callable[[Callable[["ScenarioContext"], Any]], Callable[["ScenarioContext"], Any]]:
    """Register the decorated function as scenario ``name`` (``<suite>.<what>``, see the module docstring)."""
    suite, dot, _ = name.rpartition(".")
    if not dot or not suite:
        raise ValueError(f"scenario name {name!r} must read '<suite>.<what>'")

    def register(fn: Callable[[ScenarioContext], Any]) -> Callable[[ScenarioContext], Any]:
        known = _SCENARIOS.get(name)
        if known is not None and known.__qualname__ != fn.__qualname__:
            raise ValueError(f"scenario {name!r} registered twice ({known.__module__}, {fn.__module__})")
        _SCENARIOS[name] = fn
        return fn

    return register


def suite_module(name: str) -> str:
    """The module that registers scenario ``name``: ``tests.<suite>.scenarios``."""
    return f"tests.{name.rpartition('.')[0]}.scenarios"


def resolve(name: str) -> Callable[["ScenarioContext"], Any]:
    """The function of scenario ``name``, importing ``tests.<suite>.scenarios`` to register it."""
    suite = name.rpartition(".")[0]
    importlib.import_module(suite_module(name))
    if name not in _SCENARIOS:
        raise KeyError(f"no scenario {name!r} in tests/{suite.replace('.', '/')}/scenarios.py "
                       f"(known: {sorted(_SCENARIOS)})")
    return _SCENARIOS[name]


@dataclass(frozen=True)
class ScenarioContext:
    """What a scenario function receives on each rank."""

    name: str
    params: dict[str, Any]
    out: Path
    """The run's output folder, shared by all ranks (records, checkpoints, anything a scenario writes)."""
    rank: int
    world_size: int

    def record(self, key: str, value: Any) -> None:
        """Save this rank's ``value`` as record ``key`` (``OUT/<key>.rank<r>.pt``), atomically, now."""
        save_atomic(value, str(record_path(self.out, key, self.rank)))


def record_path(out: Path, key: str, rank: int) -> Path:
    return Path(out) / f"{key}.rank{rank}.pt"


@dataclass
class ScenarioRun:
    """One launch: how it ended and its records (loaded lazily from ``out``)."""

    name: str
    nprocs: int
    out: Path
    returncode: Optional[int] = None
    timed_out: bool = False
    log: str = ""
    seconds: float = 0.0
    _loaded: dict[Path, Any] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.nprocs

    def how(self) -> str:
        return "timed out" if self.timed_out else f"exited with {self.returncode}"

    @property
    def failed(self) -> bool:
        return self.timed_out or self.returncode != 0

    def check(self) -> "ScenarioRun":
        """``self``, or an AssertionError with the tail of the log when the launch failed or timed out."""
        if self.failed:
            raise AssertionError(f"scenario {self.name} failed ({self.how()}):\n{self.log[-12000:]}")
        return self

    def _load(self, path: Path) -> Any:
        if path not in self._loaded:
            self._loaded[path] = torch.load(path, weights_only=False)
        return self._loaded[path]

    def ranks(self, key: str) -> list[Optional[Any]]:
        """Every rank's record ``key`` in rank order; None for a rank that wrote none."""
        paths = [record_path(self.out, key, r) for r in range(self.nprocs)]
        return [self._load(p) if p.exists() else None for p in paths]

    def rank0(self, key: str = "result") -> Any:
        """Rank 0's record ``key``; fails with the log when it has none."""
        got = self.ranks(key)[0]
        if got is None:
            raise AssertionError(f"scenario {self.name}: no record {key!r} from rank 0 ({self.how()}):\n"
                                 f"{self.log[-8000:]}")
        return got

    def saved(self, name: str) -> Optional[Any]:
        """What a scenario saved as ``OUT/<name>.pt`` (``worker_io.save_result``: rank 0, every rank's figures
        gathered into it), or None when there is no such file."""
        path = Path(self.out) / f"{name}.pt"
        return self._load(path) if path.exists() else None


def scenario_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment of the launched ranks (see [Note: what the harness guarantees])."""
    base = {k: v for k, v in worker_env().items()
            if k not in LAUNCHER_ENV and k not in ("GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE")
            and not k.startswith("PL_")}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    base.update(env or {})
    return base


def write_params(out: Path, name: str, params: Optional[Mapping[str, Any]]) -> Path:
    """``params`` as a JSON file of its own in ``out`` (several launches may share one folder)."""
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".json", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(params or {}), f)
    return Path(path)


def scenario_command(name: str, params_path: Path, out: Path, nprocs: int, launcher: str = "torchrun",
                     port: Optional[int] = None, nodes: int = 1, node: int = 0) -> list[str]:
    """The command line of one launch. ``torchrun``: ``nprocs`` ranks per node through torch's launcher;
    ``python``: one process, whose Lightning ``Trainer(devices=nprocs)`` starts the others itself (Lightning
    re-runs ``python -m tests.helpers.run_scenario ...`` with ``LOCAL_RANK`` set)."""
    argv = ["-m", ENTRY, name, str(params_path), str(out)]
    if launcher == "python":
        return [sys.executable, *argv]
    if launcher != "torchrun":
        raise ValueError(f"launcher {launcher!r}: 'torchrun' or 'python'")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
           f"--master-port={port or free_port()}"]
    if nodes > 1:
        cmd += [f"--nnodes={nodes}", f"--node-rank={node}", "--master-addr=127.0.0.1"]
    return cmd + argv


def start_scenario(name: str, nprocs: int, params: Optional[Mapping[str, Any]], out: Path,
                   launcher: str = "torchrun", env: Optional[Mapping[str, str]] = None,
                   stdout: Any = subprocess.PIPE) -> subprocess.Popen:
    """Start one launch of scenario ``name`` in a session of its own and return it without waiting: for
    tests that watch the processes themselves (tests/faults/launch.py: deadlines counted from an injected
    fault, worker pids outliving the launcher). Output (stdout and stderr together) goes to ``stdout``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = scenario_command(name, write_params(out, name, params), out, nprocs, launcher)
    return subprocess.Popen(cmd, cwd=ROOT, env=scenario_env(env), stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_scenario(name: str, nprocs: int = 2, params: Optional[Mapping[str, Any]] = None, timeout: float = 600,
                 out: Optional[Path] = None, nodes: int = 1, env: Optional[Mapping[str, str]] = None,
                 launcher: str = "direct") -> ScenarioRun:
    """Run scenario ``name`` on ``nprocs`` ranks per node (``nodes`` simulated nodes on this machine) with
    ``params`` (JSON-serialisable); returns the :class:`ScenarioRun` without raising (``.check()`` raises).
    Over NCCL (``LZ_TEST_ACCELERATOR=gpu``) with fewer GPUs than ranks the caller is skipped instead.
    ``launcher="direct"``: one node's ranks are started directly ([Note: ranks without torchrun's agent]);
    ``"torchrun"`` (what a test of torchrun's own reaction needs) or several nodes: one torchrun per node."""
    if launcher not in ("direct", "torchrun"):
        raise ValueError(f"launcher {launcher!r}: 'direct' or 'torchrun'")
    skip_without_gpus(nprocs * nodes)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="scenario_"))
    out.mkdir(parents=True, exist_ok=True)
    params_path = write_params(out, name, params)
    run = ScenarioRun(name, nprocs * nodes, out)
    port = free_port()
    started = time.perf_counter()
    if launcher == "direct" and nodes == 1 and not os.environ.get("LZ_TEST_TORCHRUN"):
        run.returncode, run.timed_out, run.log = _run_ranks(name, params_path, out, nprocs, port, env,
                                                            started + timeout)
        run.seconds = time.perf_counter() - started
        _log_launch(run)
        return run
    procs = [subprocess.Popen(scenario_command(name, params_path, out, nprocs, "torchrun", port, nodes, node),
                              cwd=ROOT, env=scenario_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
             for node in range(nodes)]
    logs: list[str] = []
    deadline = started + timeout
    try:
        for proc in procs:
            try:
                logs.append(proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))[0] or "")
            except subprocess.TimeoutExpired:
                run.timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                logs.append(proc.communicate()[0] or "")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    run.returncode = next((p.returncode for p in procs if p.returncode != 0), 0)
    run.log = "\n".join(logs)
    run.seconds = time.perf_counter() - started
    _log_launch(run)
    return run


def _log_launch(run: ScenarioRun) -> None:
    """One line per launch (scenario, ranks, seconds, exit) in ``$LZ_TEST_LAUNCH_LOG`` when it is set: where the
    suite's time goes."""
    path = os.environ.get("LZ_TEST_LAUNCH_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{run.name}\t{run.nprocs}\t{run.seconds:.1f}\t{run.how()}\n")


TERM_GRACE_S = 10.0
"""After a rank fails, how long the others have between SIGTERM and SIGKILL (torchrun's agent: 30 s)."""


def rank_env(env: Optional[Mapping[str, str]], rank: int, nprocs: int, port: int) -> dict[str, str]:
    """What torchrun's agent gives rank ``rank`` of one node (``--standalone``), without its store: rank 0
    hosts the rendezvous store itself (``TORCHELASTIC_USE_AGENT_STORE`` unset), as a plain ``env://`` job does."""
    return {**scenario_env(env), "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"lz-test-{port}", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def _run_ranks(name: str, params_path: Path, out: Path, nprocs: int, port: int, env: Optional[Mapping[str, str]],
               deadline: float) -> tuple[int, bool, str]:
    """(return code, timed out, log) of one node's ranks started directly.

    [Note: ranks without torchrun's agent]
    torchrun's agent is one more Python process that imports torch before it starts the ranks: about 2.4 s of
    the 2-core CI machine per launch, before any rank runs (measured 2026-11-29: a 2-rank launch that only meets
    in a barrier takes 11.1 s through torchrun and 8.7 s started directly). For one node the harness does the
    agent's part itself: each rank gets torchrun's environment (:func:`rank_env`), every rank sits in rank 0's
    process group (one ``killpg`` ends the launch and anything its ranks started), the output of all ranks goes
    to one file in arrival order (as torchrun's own stdout), and when a rank fails the others get SIGTERM at
    once and SIGKILL after :data:`TERM_GRACE_S` (torchrun's reaction). The exit code is the first non-zero
    one. Simulated multi-node runs and the fault suite (which tests the launchers themselves) keep torchrun;
    ``LZ_TEST_TORCHRUN=1`` sends every launch through it. Ranks that see no GPU are forked from a process that
    imported torch and Lightning once (forkserver.py [Note: forked ranks]; ``LZ_TEST_FORK=0``: fresh ones).
    """
    args = [name, str(params_path), str(out)]  # the entry's own arguments
    argv = [sys.executable, "-m", ENTRY, *args]
    log_path = Path(tempfile.mkstemp(prefix=".launch.", suffix=".log", dir=out)[1])
    procs: list[Any] = []  # subprocess.Popen or forkserver.ForkedRank
    timed_out = False
    zygote = _zygote(scenario_env(env))
    with open(log_path, "a") as log:  # appends, as the forked ranks do ([Note: forked ranks])
        try:
            for rank in range(nprocs):
                pgid = 0 if rank == 0 else procs[0].pid  # rank 0 leads a group of its own
                renv = rank_env(env, rank, nprocs, port)
                forked = zygote.fork(args, renv, log_path, pgid, suite_module(name)) if zygote is not None else None
                procs.append(forked or subprocess.Popen(argv, cwd=ROOT, env=renv, stdout=log, stderr=subprocess.STDOUT,
                                                        stdin=subprocess.DEVNULL, process_group=pgid))
            failed_at: Optional[float] = None
            while any(p.poll() is None for p in procs):
                now = time.perf_counter()
                if now >= deadline:
                    timed_out = True
                    break
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                    _signal_group(procs[0].pid, signal.SIGTERM)
                elif failed_at is not None and now - failed_at > TERM_GRACE_S:
                    break
                time.sleep(0.05)
        finally:
            if procs and any(p.poll() is None for p in procs):
                _signal_group(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    summary = [f"[harness] rank {r} (pid {p.pid}) " + (f"died of {signal.Signals(-p.returncode).name}"
               if p.returncode < 0 else f"exited with {p.returncode}") for r, p in enumerate(procs) if p.returncode]
    return code, timed_out, log_path.read_text(errors="replace") + "".join(f"\n{line}" for line in summary)


def _zygote(env: Mapping[str, str]) -> Any:
    """The zygote that forks this launch's ranks ([Note: forked ranks]), or None where they start fresh."""
    from tests.helpers import forkserver

    if not forkserver.forkable(env, nodes=1, launcher="direct"):
        return None
    return _zygotes().get(env)


@functools.cache
def _zygotes() -> Any:
    """This pytest process's :class:`tests.helpers.forkserver.Zygotes`, made on the first forked launch."""
    from tests.helpers.forkserver import Zygotes

    return Zygotes()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # every process of the group has exited
        pass


def barrier_or_exit(tag: str, timeout_s: float) -> None:
    """After a failed run inside a multi-run worker: go on only if every rank got here within ``timeout_s``
    (else their collectives would pair with the wrong partners in the next run); otherwise exit this rank."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except Exception as exc:  # noqa: BLE001 - any failure to meet ends the worker
        print(f"[{tag} rank {dist.get_rank()}] ranks cannot meet after a failure ({exc}); exiting", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)
