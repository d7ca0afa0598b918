"""lightning_zero against Lightning's own strategies and DeepSpeed, side by side, in one run.

Trains the GPT-1.3B workload of issues 2 and 3 (``conf/model/gpt_1b.yaml``, micro-batch 8 per GPU,
seq 1024, ``bf16-mixed``, torch AdamW(fused=True)) for a few steps under each configuration and
prints a markdown table: tokens/s, ratio to the baseline (``single`` on 1 GPU, ``ddp`` on 2),
TFLOP/s and MFU per GPU, peak memory per GPU, then the issues' targets as PASS/FAIL.

    python3 benchmarks/peers.py --gpus 1                     # single zero{1,2,3} fsdp deepspeed_stage_{2,3}
    python3 benchmarks/peers.py --gpus 2 --write-results     # ddp zero{1,2,3} fsdp deepspeed_stage_{2,3}
    python3 benchmarks/peers.py --gpus 1 --configs single,zero2 --steps 20 --warmup 5
    python3 benchmarks/peers.py --device cpu --model tiny --gpus 2 --configs ddp,zero2 --steps 3 --warmup 1
    python3 benchmarks/peers.py --from-results runs/peers/<run>/results.jsonl   # re-render a run's table
    python3 benchmarks/peers.py --gpus 2 --profile --configs ddp,zero3 --steps 8 --warmup 3   # + exposed comm

``--profile``: after its timed steps, each configuration profiles 3 more (``torch.profiler``, CPU +
CUDA, every rank, nothing exported) and the table gains a column "comm (exposed / total)": the time
only NCCL kernels ran on the device, and the time any ran, as fractions of the profiled wall time
(``overlap.py``). The timed steps, and so every other column, are those of a run without it.

Why one process tree per configuration: CUDA's caching allocator, NCCL communicators, cuBLAS
workspaces and DeepSpeed's global state would otherwise carry from one peer into the next one's
memory and speed. One GPU: ``python peers_worker.py``; N GPUs: ``python -m torch.distributed.run
--standalone --nproc-per-node N peers_worker.py`` (the engine users run; Lightning sees torchrun and
starts no processes of its own). This parent never imports torch, so it holds no CUDA context.

A configuration that fails (OOM, DeepSpeed not importable, ``ZeroStrategy(stage=3)`` not built yet,
a hang past ``--config-timeout-s``) becomes a row with the reason; the run goes on. ``--budget-s``
bounds the whole run (the GPU machine's 10-minute command limit): configurations that no longer fit
are listed as skipped, and the table is always printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
from benchmarks.peers_report import append_section, read_records, render_section  # noqa: E402
from benchmarks.presets import PEERS, baseline, default_peers, model_label, model_preset  # noqa: E402

WORKER = HERE / "peers_worker.py"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off in every process we start (the lent machines' rule: it can take the host's
shared GPUs out of service)."""
ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(Error|Exception|Interrupt)\b:?.*)")


# ---------------------------------------------------------------------------------------------------- arguments


def add_gpt_args(p: argparse.ArgumentParser, configs: list[str], gpus: int = 1, steps: int = 10, warmup: int = 4,
                 warmup_help: str = "untimed steps before them") -> None:
    """The options every GPT comparison's parent takes (compile.py, fabric.py, tp.py): machine size,
    which configurations, the GPT preset, micro-batch and step counts."""
    p.add_argument("--gpus", type=int, default=gpus)
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {configs}")
    p.add_argument("--model", default="gpt_1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)


def add_runner_args(p: argparse.ArgumentParser, config_timeout_s: float, min_config_s: float) -> None:
    """The options every peer benchmark's run loop (:func:`run_benchmark`) reads."""
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke mode with gloo")
    p.add_argument("--config-timeout-s", type=float, default=config_timeout_s, help="kill a configuration after this long")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run")
    p.add_argument("--min-config-s", type=float, default=min_config_s, help="don't start a configuration with less left")
    p.add_argument("--out-dir", type=Path, default=None, help="results.jsonl, per-config logs, table.md")
    p.add_argument("--write-results", action="store_true", help="append a dated section to --results-md")
    p.add_argument("--results-md", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--from-results", type=Path, default=None, help="only re-render the table of a results.jsonl")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1, help="GPUs (CPU processes with --device cpu) per configuration")
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {sorted(PEERS)}")
    p.add_argument("--model", default="gpt_1b", help="conf/model preset (gpt_1b, gpt_small, gpt_tiny/tiny) or a YAML")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per GPU per step")
    p.add_argument("--steps", type=int, default=15, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    add_runner_args(p, config_timeout_s=180.0, min_config_s=40.0)
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile 3 more (torch.profiler) and add the exposed communication "
                        "fraction to the table (off by default: the timed steps are the same either way)")
    args = p.parse_args(argv)
    if args.gpus < 1 or args.steps < 1 or args.warmup < 0 or args.micro_batch < 1:
        p.error("--gpus, --steps and --micro-batch must be >= 1 and --warmup >= 0")
    names = args.configs.split(",") if args.configs else default_peers(args.gpus)
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; valid ones are {sorted(PEERS)}")
    args.config_names = names
    return args


# ---------------------------------------------------------------------------------------------------- environment


def nvidia_smi(field: str) -> Optional[str]:
    """One property of GPU 0 from nvidia-smi (no CUDA context in this process), or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()
    return first[0].strip() if first else None


def dist_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def child_env(args: argparse.Namespace, family: str) -> dict[str, str]:
    """The environment of one configuration's processes."""
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.gpus)))
    if family == "deepspeed" and args.device == "cuda":
        # DeepSpeed's JIT op builder rejects the machine's default TORCH_CUDA_ARCH_LIST ("9.0a").
        env["TORCH_CUDA_ARCH_LIST"] = nvidia_smi("compute_cap") or "9.0"
    return env


def worker_cmd(args: argparse.Namespace, config: str, results: Path, fused: bool) -> list[str]:
    """python (1 process) or torchrun (N processes) on peers_worker.py."""
    launch = [sys.executable]
    if args.gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={args.gpus}"]
    cmd = launch + [
        str(WORKER), "--config", config, "--model", args.model, "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
        "--devices", str(args.gpus), "--results-file", str(results),
    ]
    return cmd + ([] if fused else ["--no-fused"]) + (["--profile"] if args.profile else [])


# ---------------------------------------------------------------------------------------------------- children


@dataclass
class ChildResult:
    returncode: Optional[int]
    timed_out: bool
    seconds: float
    tail: list[str]


def _pump(stream, prefix: str, log, tail: deque) -> None:  # type: ignore[no-untyped-def]
    """Copy a child's output to our stdout (prefixed) and its log, keeping the tail for error reasons."""
    for line in iter(stream.readline, ""):
        log.write(line)
        tail.append(line.rstrip("\n"))
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()
    stream.close()


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the child's own process group (it was started in a new session).

    torchrun answers SIGTERM by stopping its workers (SIGTERM, then SIGKILL after 30 s), so it gets
    that long before it is killed itself; workers it leaves behind are caught by :func:`reap_workers`.
    """
    for sig, wait in ((signal.SIGTERM, 45.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def reap_workers(pid_file: Path, worker_name: str = WORKER.name) -> list[int]:
    """SIGKILL any worker of ours still alive after its launcher ended; returns the pids killed.

    torchrun starts each worker in a session of its own, so a worker hung in a collective survives
    its launcher's death, and on the GPU machine it would hold GPU memory through every later
    configuration. Workers write their pid to ``pid_file``; each is checked to still be a
    ``peers_worker.py`` (``worker_name``) before it is killed (no pid reuse accidents).
    """
    killed: list[int] = []
    if not pid_file.is_file():
        return killed
    for text in pid_file.read_text().split():
        pid = int(text)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if worker_name.encode() in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def run_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float, prefix: str) -> ChildResult:
    tail: deque = deque(maxlen=80)
    start = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", bufsize=1, start_new_session=True,
        )
        pump = threading.Thread(target=_pump, args=(proc.stdout, prefix, log, tail), daemon=True)
        pump.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
        pump.join(timeout=10)
    return ChildResult(proc.returncode, timed_out, time.monotonic() - start, list(tail))


def reason_from_tail(result: ChildResult) -> str:
    """The last exception line a dead child printed, else its exit code."""
    if result.timed_out:
        return f"timed out after {result.seconds:.0f} s (killed)"
    for line in reversed(result.tail):
        m = ERROR_LINE.search(line)
        if m and "Traceback" not in line:
            return m.group(1).strip()[:300]
    return f"exit code {result.returncode}"


# ---------------------------------------------------------------------------------------------------- one config


def _note(results: Path, config: str, attempt: int, **fields: object) -> None:
    with results.open("a") as fh:
        fh.write(json.dumps({"config": config, "attempt": attempt, **fields}) + "\n")


def worker_launch(gpus: int) -> list[str]:
    """The launcher of a benchmark worker: python (one process) or torchrun over ``gpus`` processes."""
    launch = [sys.executable]
    if gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={gpus}"]
    return launch


def select_configs(p: argparse.ArgumentParser, args: argparse.Namespace, valid: Sequence[str],
                   default: Sequence[str]) -> None:
    """``args.config_names`` from ``--configs`` (or ``default``); an unknown name is a usage error."""
    names = args.configs.split(",") if args.configs else list(default)
    unknown = [n for n in names if n not in valid]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; valid ones are {list(valid)}")
    args.config_names = names


def run_once(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float],
             cmd: Callable[[Path], list[str]], env: dict[str, str], worker_name: str, label: str = "",
             stamp_config: bool = False) -> None:
    """One configuration, once (the benchmarks without peers.py's fused-optimizer retry: compile.py,
    fabric.py, lora.py); every outcome (skip for lack of time, failure, timeout) is recorded as a row.
    ``cmd(attempt_file)`` is the worker command; ``stamp_config`` renames the worker's records to
    ``config`` (a shared worker that names its peer differently)."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left < args.min_config_s:
        _note(results, config, 0, kind="error", status="skipped", rank=0,
              reason=f"out of time budget ({max(0.0, left):.0f} s left)")
        return
    timeout = args.config_timeout_s if left is None else min(args.config_timeout_s, left)
    attempt_file = out_dir / f"{config}.jsonl"
    attempt_file.unlink(missing_ok=True)
    attempt_file.with_suffix(".pids").unlink(missing_ok=True)
    print(f"==> {config} ({label + ', ' if label else ''}timeout {timeout:.0f} s)")
    result = run_child(cmd(attempt_file), env, out_dir / f"{config}.log", timeout, prefix=f"[{config}] ")
    killed = reap_workers(attempt_file.with_suffix(".pids"), worker_name)
    if killed:
        print(f"... {config}: killed leftover worker processes {killed}")
    records = read_records(attempt_file)
    with results.open("a") as fh:
        for r in records:
            fh.write(json.dumps({**r, **({"config": config} if stamp_config else {}), "attempt": 0}) + "\n")
    if not records or result.timed_out:
        _note(results, config, 0, kind="error", status="failed", rank=-1, reason=reason_from_tail(result))
    elif result.returncode not in (0, None) and not any(r.get("kind") == "error" for r in records):
        _note(results, config, 0, kind="note", note=f"exit code {result.returncode} after recording")
    ok = result.returncode == 0 and not result.timed_out
    print(f"<== {config}: {'ok' if ok else 'failed'} in {result.seconds:.0f} s")


def _attempt_failed_on_fused(results: Path, config: str, attempt: int, result: ChildResult) -> bool:
    """Whether the attempt's recorded reasons (or its last exception line) blame the fused optimizer."""
    reasons = [
        str(r.get("reason", "")) for r in read_records(results)
        if r.get("config") == config and r.get("attempt", 0) == attempt
    ]
    return "fused" in " ".join(reasons + [reason_from_tail(result)]).lower()


def run_config(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float]) -> None:
    """Run one configuration (retrying without fused AdamW if that is what failed); record every outcome."""
    family = PEERS[config]
    if family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        _note(results, config, 0, kind="error", status="skipped", rank=0, reason="deepspeed is not installed")
        return
    for attempt, fused in enumerate((True, False)):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < args.min_config_s:
            if attempt == 0:  # a retry that no longer fits leaves the first attempt's failure as the row
                _note(results, config, attempt, kind="error", status="skipped", rank=0,
                      reason=f"out of time budget ({max(0.0, left):.0f} s left)")
            return
        timeout = args.config_timeout_s if left is None else min(args.config_timeout_s, left)
        # Each attempt's records carry its number: the worker does not know it, so use a file per attempt
        # and merge, tagging lines as they are copied.
        attempt_file = out_dir / f"{config}.attempt{attempt}.jsonl"
        attempt_file.unlink(missing_ok=True)
        attempt_file.with_suffix(".pids").unlink(missing_ok=True)
        print(f"==> {config} (attempt {attempt + 1}, {'fused' if fused else 'plain'} AdamW, timeout {timeout:.0f} s)")
        result = run_child(
            worker_cmd(args, config, attempt_file, fused), child_env(args, family),
            out_dir / f"{config}.log", timeout, prefix=f"[{config}] ",
        )
        killed = reap_workers(attempt_file.with_suffix(".pids"))
        if killed:
            print(f"... {config}: killed leftover worker processes {killed}")
        records = read_records(attempt_file)
        with results.open("a") as fh:
            for r in records:
                fh.write(json.dumps({**r, "attempt": attempt}) + "\n")
        if not records or result.timed_out:
            _note(results, config, attempt, kind="error", status="failed", rank=-1, reason=reason_from_tail(result))
        elif result.returncode not in (0, None) and not any(r.get("kind") == "error" for r in records):
            _note(results, config, attempt, kind="note", note=f"exit code {result.returncode} after recording")
        ok = result.returncode == 0 and not result.timed_out
        print(f"<== {config}: {'ok' if ok else 'failed'} in {result.seconds:.0f} s")
        if ok or not fused or not _attempt_failed_on_fused(results, config, attempt, result):
            return
        print(f"... {config}: the failure mentions 'fused'; retrying with plain AdamW")


# ---------------------------------------------------------------------------------------------------- main


def meta(args: argparse.Namespace, command: str) -> dict[str, object]:
    """Everything the table's header needs that no child reports (the children report versions too)."""
    return {
        "kind": "meta",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": args.gpus,
        "device_type": args.device,
        "device_name": nvidia_smi("name") if args.device == "cuda" else platform.machine(),
        "configs": args.config_names,
        "baseline": baseline(args.gpus),
        "model": {"name": model_label(args.model), "dims": model_preset(args.model)},
        "micro_batch": args.micro_batch,
        "precision": "bf16-mixed",
        "warmup": args.warmup,
        "steps": args.steps,
        "profile": args.profile,
        "command": command,
        "reference_comparable": model_label(args.model) == "gpt_1b" and args.micro_batch == 8 and args.device == "cuda",
        "versions": {
            **{k: dist_version(k) for k in ("torch", "lightning", "deepspeed")},
            "lightning_zero": dist_version("lightning-zero"),
            "python": platform.python_version(),
        },
    }


def finish(records_path: Path, args: argparse.Namespace, out_dir: Optional[Path],
           render: Callable[[list[dict]], str] = render_section) -> str:
    section = render(read_records(records_path))
    print("\n" + section)
    if out_dir is not None:
        (out_dir / "table.md").write_text(section)
    if args.write_results:
        append_section(args.results_md, section)
        print(f"appended to {args.results_md}")
    return section


def run_benchmark(args: argparse.Namespace, argv: Optional[list[str]], name: str,
                  meta_fn: Callable[[argparse.Namespace, str], dict], run_one: Callable[..., None],
                  render: Callable[[list[dict]], str] = render_section) -> int:
    """The whole run of a peer benchmark (this one, lora.py): one configuration after another into
    ``runs/<name>/<stamp>/results.jsonl``, then the table (and RESULTS.md with ``--write-results``)."""
    if args.from_results is not None:
        finish(args.from_results, args, None, render)
        return 0
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or REPO / "runs" / name / f"{stamp}-{args.gpus}{'gpu' if args.device == 'cuda' else 'cpu'}"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    results.unlink(missing_ok=True)
    command = shlex.join(["python3", os.path.relpath(sys.argv[0], REPO) if argv is None else f"benchmarks/{name}.py",
                          *(sys.argv[1:] if argv is None else argv)])
    with results.open("a") as fh:
        fh.write(json.dumps(meta_fn(args, command)) + "\n")
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    print(f"{name}: {args.config_names} on {args.gpus} {args.device} device(s); results in {out_dir}")
    for config in args.config_names:
        run_one(args, config, results, out_dir, deadline)
    finish(results, args, out_dir, render)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv), argv, "peers", meta, run_config)


if __name__ == "__main__":
    sys.exit(main())
