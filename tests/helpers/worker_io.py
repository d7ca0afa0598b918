"""What every multi-run test worker does around its runs: ``worker.py OUT name=spec ...`` runs each
spec in one process group, and rank 0 saves each run's result with every rank's own figures.

One place for it: the workers of tests/helpers (dist_worker.py), tests/compile and tests/pipeline
repeated the gather, the save and the argument loop.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist


def save_result(result: dict[str, Any], per_rank: dict[str, Any], out: str, name: str) -> None:
    """Collective: gather ``per_rank`` from every rank into ``result["per_rank"]`` (rank order) and
    save ``result`` as ``OUT/<name>.pt`` on rank 0. Written to a temporary file and renamed, so a
    reader never sees a half-written file (a worker that dies while saving leaves none). One process
    without a process group (a single-device run) saves its own figures."""
    if not dist.is_initialized():
        result["per_rank"] = [per_rank]
        save_atomic(result, os.path.join(out, f"{name}.pt"))
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_rank)
    if dist.get_rank() == 0:
        result["per_rank"] = gathered
        save_atomic(result, os.path.join(out, f"{name}.pt"))


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run_specs(run: Callable[[str, str, str], None]) -> None:
    """Call ``run(name, spec, out)`` for each ``name=spec`` argument after ``OUT``, in order."""
    out = sys.argv[1]
    for item in sys.argv[2:]:
        name, _, spec = item.partition("=")
        run(name, spec, out)


def parse_specs(argv: list[str]) -> list[tuple[str, str, dict[str, str]]]:
    """``name=kind:key=value,...`` arguments -> (name, kind, options), in order."""
    out = []
    for arg in argv:
        name, spec = arg.split("=", 1)
        kind, _, rest = spec.partition(":")
        out.append((name, kind, dict(kv.split("=", 1) for kv in rest.split(",") if kv)))
    return out


def run_against_oracle(run_zero: Callable[[int, dict[str, str]], dict[str, Any]],
                       run_ref: Callable[[dict[str, str]], dict[str, Any]]) -> None:
    """``worker.py OUT name=zeroS:opts ... name=ref:opts``: every ``zeroS`` spec runs on all ranks (seeded
    alike), every ``ref`` spec once on rank 0 (the one-process oracle); rank 0 saves each result as
    ``OUT/<name>.pt``."""
    import lightning.pytorch as pl

    out = sys.argv[1]
    results: dict[str, Any] = {}
    refs = []
    for name, kind, opts in parse_specs(sys.argv[2:]):
        if kind == "ref":
            refs.append((name, opts))
            continue
        pl.seed_everything(0)
        results[name] = run_zero(int(kind[-1]), opts)
    if int(os.environ.get("RANK", "0")) == 0:
        for name, opts in refs:
            results[name] = run_ref(opts)
        for name, res in results.items():
            save_atomic(res, os.path.join(out, f"{name}.pt"))
