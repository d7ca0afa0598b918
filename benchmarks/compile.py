"""torch.compile's speed-up under each strategy, side by side, in one run (issue #16).

GPT-1.3B (``conf/model/gpt_1b.yaml``), micro-batch 8 per GPU, seq 1024, ``bf16-mixed``, torch
AdamW(fused=True), each configuration eager and compiled (``<peer>`` and ``<peer>_compiled``):

* 1 GPU: ``single`` (Lightning's single device), ``zero3`` (``ZeroStrategy(stage=3)``), ``fsdp``
  (Lightning's FSDPStrategy as its docs advise for compile: FULL_SHARD, ``auto_wrap_policy={Block}``,
  ``use_orig_params=True``);
* 2 or 4 GPUs: ``ddp``, ``zero3`` and ``fsdp`` (issue #32).

Compiled = the example's ``model.compile=true``: every transformer block ``.compile()``d (inductor,
torch's default mode: no CUDA graphs), the same code under every strategy (compile_worker.py). The
table has peers.py's columns plus the compile speed-up over the same peer's eager run and what
dynamo counted (graph breaks, unique graphs); then the issue's targets as same-run ratios:
``zero3_compiled`` >= 0.98x ``single_compiled`` and >= 1.0x ``fsdp_compiled`` on 1 GPU, >= 1.0x
``ddp_compiled`` on 2; on 2 and 4 GPUs (issue #32) >= 1.0x ``ddp_compiled`` and >= 1.1x ``fsdp_compiled``.

    python3 benchmarks/compile.py --gpus 1 --budget-s 460          # ~7 min on one H100/H200
    python3 benchmarks/compile.py --gpus 2 --budget-s 460          # nvidia-h200-x2
    python3 benchmarks/compile.py --device cpu --model tiny --gpus 1 --configs zero3,zero3_compiled --steps 2 --warmup 3

As peers.py (whose run loop, process handling and table this reuses): one process tree per
configuration, this parent never imports torch, failures and timeouts become rows, ``--budget-s``
bounds the run and the table is always printed. Compilation happens during the warm-up steps (under
ZeRO-3 the first batch runs eagerly: zero/compile.py [Note: first batches run eagerly]).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
from benchmarks.peers import (  # noqa: E402
    add_gpt_args, add_runner_args, child_env, meta as peers_meta, run_benchmark, run_once, select_configs, worker_launch,
)
from benchmarks.peers_report import (  # noqa: E402
    Row, Target, _fmt, render_gpt_section,
)

WORKER = HERE / "compile_worker.py"
DEFAULTS = {
    1: ["single_compiled", "zero3_compiled", "fsdp_compiled", "single", "zero3", "fsdp"],
    2: ["ddp_compiled", "zero3_compiled", "fsdp_compiled", "ddp", "zero3", "fsdp"],
}
"""Compiled runs first (the targets need them), then the eager ones (the speed-ups)."""
FP8 = ["zero3_fp8_compiled", "zero3_fp8_rowwise_compiled", "zero3_fp8_head_compiled", "zero3_fp8", "zero3_fp8_rowwise",
       "zero3_fp8_head"]
"""Issue #33's FP8 rows (``--configs``, not by default): fp8 linears (torchao) against ``zero3_compiled``."""
ALL = sorted({c for cs in DEFAULTS.values() for c in cs} | set(FP8))
TARGETS: tuple[Target, ...] = (
    Target(1, "zero3_compiled", "tokens", "single_compiled", 0.98, 16),
    Target(1, "zero3_compiled", "tokens", "fsdp_compiled", 1.0, 16),
    Target(2, "zero3_compiled", "tokens", "ddp_compiled", 1.0, 16),
    Target(2, "zero3_compiled", "tokens", "fsdp_compiled", 1.1, 32),
    Target(4, "zero3_compiled", "tokens", "ddp_compiled", 1.0, 32),
    Target(4, "zero3_compiled", "tokens", "fsdp_compiled", 1.1, 32),
    Target(1, "zero3_fp8_compiled", "tokens", "zero3_compiled", 1.25, 33),
    Target(2, "zero3_fp8_compiled", "tokens", "zero3_compiled", 1.25, 33),
    Target(4, "zero3_fp8_compiled", "tokens", "zero3_compiled", 1.25, 33),
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_args(p, ALL, steps=10, warmup=4, warmup_help="untimed steps before them (compilation happens here)")
    add_runner_args(p, config_timeout_s=240.0, min_config_s=45.0)
    args = p.parse_args(argv)
    if args.warmup < 3:
        p.error("--warmup must be >= 3 (ZeRO-3's first batch runs eagerly, compilation takes the next ones)")
    select_configs(p, args, ALL, DEFAULTS[1 if args.gpus == 1 else 2])
    args.profile = False
    return args


def worker_cmd(args: argparse.Namespace, config: str, results: Path) -> list[str]:
    launch = worker_launch(args.gpus)
    return launch + [
        str(WORKER), "--config", config, "--model", args.model, "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
        "--devices", str(args.gpus), "--results-file", str(results),
    ]


def run_config(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float]) -> None:
    run_once(args, config, results, out_dir, deadline, lambda f: worker_cmd(args, config, f),
             child_env(args, "lightning"), WORKER.name)


def meta(args: argparse.Namespace, command: str) -> dict[str, Any]:
    out = peers_meta(args, command)
    out["baseline"] = "single_compiled" if args.gpus == 1 else "ddp_compiled"
    out["reference_comparable"] = False  # DESIGN §7's figures are eager runs
    return out


def _compile_columns(records: list[dict[str, Any]], rows: list[Row]) -> str:
    """Per peer: compiled tokens/s over eager tokens/s, and dynamo's counters of the compiled run (rank 0)."""
    by_name = {r.config: r for r in rows}
    lines = ["| peer | eager tokens/s | compiled tokens/s | compile speed-up | graph breaks | unique graphs | compiled blocks | ZeRO-3 plan |",
             "|---|---|---|---|---|---|---|---|"]
    for peer in ("single", "ddp", "fsdp", "zero3", "zero3_fp8", "zero3_fp8_rowwise", "zero3_fp8_head"):
        eager, comp = by_name.get(peer), by_name.get(f"{peer}_compiled")
        if eager is None and comp is None:
            continue
        rank0 = next((r for r in records if r.get("config") == f"{peer}_compiled" and r.get("kind") == "rank"
                      and r.get("rank") == 0), {})
        e = eager.tokens_per_s if eager is not None and eager.status == "ok" else None
        c = comp.tokens_per_s if comp is not None and comp.status == "ok" else None
        lines.append("| " + " | ".join([
            f"`{peer}`", _fmt(e, ",.0f"), _fmt(c, ",.0f"), _fmt(c / e if c and e else None, ".3f") + ("×" if c and e else ""),
            str(rank0.get("graph_breaks", "–")), str(rank0.get("unique_graphs", "–")), str(rank0.get("compiled_blocks", "–")),
            json.dumps(rank0["compile_plan"]) if rank0.get("compile_plan") else "–",
        ]) + " |")
    return "\n".join(lines)


def render_section(records: list[dict[str, Any]], configs: Optional[list[str]] = None) -> str:
    return render_gpt_section(records, configs, "torch.compile",
        "compiled = every block `.compile()`d (inductor, default mode; the warm-up steps compile); `fsdp` = FULL_SHARD, "
        "auto_wrap_policy={Block}, use_orig_params=True.",
        _compile_columns, TARGETS)


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv), argv, "compile", meta, run_config, render_section)


if __name__ == "__main__":
    sys.exit(main())
