"""What every multi-run scenario does around its runs: the ``runs`` parameter ``{name: spec, ...}`` (see
``tests.helpers.launch.run_worker``) runs each spec in one process group, and rank 0 saves each run's result
with every rank's own figures as ``OUT/<name>.pt``.

One place for it: the parity, compile, pipeline, parallel and MoE scenarios repeated the gather, the save and
the loop over runs.
"""

from __future__ import annotations

import os
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


def run_specs(run: Callable[[str, str, str], None], ctx: Any) -> None:
    """Call ``run(name, spec, out)`` for each ``name: spec`` of the scenario's ``runs`` parameter, in order
    (``ctx``: the :class:`tests.helpers.harness.ScenarioContext`)."""
    for name, spec in ctx.params["runs"].items():
        run(name, spec, str(ctx.out))


def parse_specs(runs: dict[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    """``{name: "kind:key=value,..."}`` -> (name, kind, options), in order."""
    out = []
    for name, spec in runs.items():
        kind, _, rest = spec.partition(":")
        out.append((name, kind, dict(kv.split("=", 1) for kv in rest.split(",") if kv)))
    return out


def run_against_oracle(run_zero: Callable[[int, dict[str, str]], dict[str, Any]],
                       run_ref: Callable[[dict[str, str]], dict[str, Any]], ctx: Any) -> None:
    """Runs ``{name: "zeroS:opts", ..., name: "ref:opts"}``: every ``zeroS`` spec runs on all ranks (seeded
    alike), every ``ref`` spec once on rank 0 (the one-process oracle); rank 0 saves each result as
    ``OUT/<name>.pt``."""
    import lightning.pytorch as pl

    out = str(ctx.out)
    results: dict[str, Any] = {}
    refs = []
    for name, kind, opts in parse_specs(ctx.params["runs"]):
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
