"""What a benchmark worker process writes, and how a failure becomes a table row instead of a crash.

Each rank appends JSON lines to ``--results-file`` (:func:`append_record`: one ``write(2)`` per line, so
concurrent ranks never interleave); :func:`run_as_row` turns a strategy that cannot be built into a
'skipped' row and any other failure into a 'failed' row; :func:`worker_main` is every worker's entry
point. The parent (``benchmarks/peers.py``'s runner) reads the lines back and renders the tables
(``peers_report.py``). Shared by every ``*_worker.py``; nothing here knows which model is trained.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch


def _rank() -> int:
    """Global rank before (or without) a Trainer: torchrun's RANK, else 0."""
    return int(os.environ.get("RANK", "0"))


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, one write(2) on an O_APPEND file: lines from concurrent ranks never interleave."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Optional[str]]:
    """Versions of everything that shapes the numbers (metadata only: importing DeepSpeed is slow)."""
    import lightning

    import lightning_zero

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "deepspeed": _version("deepspeed"),
        "lightning_zero": lightning_zero.__version__,
        "python": sys.version.split()[0],
    }


def short_reason(exc: BaseException) -> str:
    """One line for the table: exception type and the first line of its message, capped."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def device_info(device: torch.device) -> tuple[str, Optional[float]]:
    """Device name for the table and its peak dense bf16 FLOP/s (for MFU), from lightning_zero's table."""
    if device.type != "cuda":
        import platform

        return (platform.processor() or platform.machine() or "cpu"), None
    from lightning_zero.logging.metrics import peak_bf16_flops

    name = torch.cuda.get_device_name(device)
    return name, peak_bf16_flops(name)


def _shutdown_process_group() -> None:
    """Tear NCCL down explicitly: exiting with a live communicator can hang or print warnings at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the numbers are recorded already; never fail the run on teardown
            print(f"destroy_process_group failed: {short_reason(exc)}", file=sys.stderr)


def run_as_row(args: argparse.Namespace, build_strategy: Callable[[], Any], body: Callable[[Any], None],
               skip_on: tuple[type[BaseException], ...] = (NotImplementedError, ValueError)) -> int:
    """One configuration in this worker: a strategy that cannot be built here (``skip_on``) becomes a
    'skipped' row, any other failure a 'failed' row with its traceback in the log; the parent renders
    its table from these rows (peers.py, lora.py and checkpoint.py share this)."""
    base = {"kind": "error", "config": args.config, "rank": _rank()}
    try:
        strategy = build_strategy()
    except skip_on as exc:
        append_record(args.results_file, {**base, "status": "skipped", "reason": short_reason(exc)})
        return 0
    except Exception as exc:  # e.g. `import deepspeed` failing on this machine
        append_record(args.results_file, {**base, "status": "failed", "reason": short_reason(exc)})
        return 1
    try:
        body(strategy)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes a table row, with its traceback in the log
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc()
        append_record(args.results_file, {**base, "status": "failed", "reason": short_reason(exc)})
        return 1
    return 0


def worker_main(argv: Optional[list[str]], parse: Callable[[Optional[list[str]]], argparse.Namespace],
                run_one: Callable[[argparse.Namespace], int], ignore: tuple[str, ...] = ()) -> int:
    """A benchmark worker's entry point: quiet known warnings, record this pid (the parent kills
    workers that outlive their launcher: torchrun puts each in its own session), run."""
    for pattern in (".*does not have many workers.*", ".*smaller than the logging interval.*", *ignore):
        warnings.filterwarnings("ignore", pattern)
    args = parse(argv)
    with args.results_file.with_suffix(".pids").open("a") as fh:
        fh.write(f"{os.getpid()}\n")
    code = run_one(args)
    sys.stdout.flush()
    return code


__all__ = ["append_record", "device_info", "run_as_row", "short_reason", "versions", "worker_main"]
