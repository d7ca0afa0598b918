"""Tensor parallelism against Lightning's ModelParallelStrategy with the same plan, side by side (issue #17).

Two workloads, each under two strategies, each configuration in its own torchrun (tp_worker.py):

* ``gpt_*``: GPT-1.3B (``conf/model/gpt_1b.yaml``), micro-batch 8 per replica, seq 1024, plan
  ``tp_plan_gpt`` (every block's MLP column/row-split; attention replicated);
* ``llama_*``: Llama-3-8B's shape (``presets.LLAMA_PRESETS["llama_8b"]``, random weights, HF
  ``LlamaForCausalLM``), micro-batch 1 per replica, seq 2048, plan ``tp_plan_llama`` (q/k/v/gate/up
  column-wise, o/down row-wise); ``--llama-layers`` shortens it if the full depth does not fit;
* ``*_zero``: ``ZeroStrategy(stage=1, tensor_parallel=2)``; ``*_mps``: Lightning's
  ``ModelParallelStrategy(tensor_parallel_size=2)`` (FSDP2 over its data-parallel dim where that is > 1).

``bf16-mixed``, torch AdamW(fused=True), the network built in ``configure_model`` on the GPU and the plan
applied there by the same call under both strategies. Targets (the issue's Performance section), as
same-run ratios: ``*_zero`` tokens/s >= 1.0x ``*_mps``, peak memory <= 1.0x.

    python3 benchmarks/tp.py --gpus 2 --budget-s 560                           # nvidia-h200-x2
    python3 benchmarks/tp.py --gpus 2 --configs llama_zero,llama_mps --llama-layers 16
    python3 benchmarks/tp.py --device cpu --gpus 2 --model gpt_tiny --llama llama_tiny --micro-batch 2 --steps 2 --warmup 1

As peers.py (whose run loop, process handling and table this reuses): one process tree per
configuration, this parent never imports torch, failures and timeouts become rows, ``--budget-s``
bounds the run and the table is always printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
from benchmarks.peers import (  # noqa: E402
    add_gpt_args, add_runner_args, child_env, meta as peers_meta, run_benchmark, run_once, select_configs, worker_launch,
)
from benchmarks.peers_report import Row, Target, _fmt, render_gpt_section  # noqa: E402
from benchmarks.presets import llama_preset  # noqa: E402

WORKER = HERE / "tp_worker.py"
ALL = ["gpt_zero", "gpt_mps", "llama_zero", "llama_mps"]
TARGETS: tuple[Target, ...] = tuple(
    Target(2, f"{m}_zero", metric, f"{m}_mps", 1.0, 17) for m in ("gpt", "llama") for metric in ("tokens", "memory")
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_args(p, ALL, gpus=2, steps=10, warmup=3)  # --model and --micro-batch: the gpt_* runs (per replica)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: --gpus)")
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage of the *_zero runs (over dp = gpus / tp)")
    p.add_argument("--llama", default="llama_8b", help="Llama preset of the llama_* runs (benchmarks/presets.py)")
    p.add_argument("--llama-micro-batch", type=int, default=1)
    p.add_argument("--llama-layers", type=int, default=None)
    p.add_argument("--llama-seq", type=int, default=None)
    add_runner_args(p, config_timeout_s=300.0, min_config_s=60.0)
    args = p.parse_args(argv)
    args.tp = args.tp or args.gpus
    if args.tp < 2 or args.gpus % args.tp:
        p.error(f"--tp {args.tp} must be >= 2 and divide --gpus {args.gpus}")
    llama_preset(args.llama, args.llama_layers, args.llama_seq)  # an unknown preset is a usage error here
    select_configs(p, args, ALL, ALL)
    args.profile = False
    return args


def worker_cmd(args: argparse.Namespace, config: str, results: Path) -> list[str]:
    llama = config.startswith("llama")
    cmd = worker_launch(args.gpus) + [
        str(WORKER), "--config", config, "--model", args.model, "--llama", args.llama,
        "--micro-batch", str(args.llama_micro_batch if llama else args.micro_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
        "--devices", str(args.gpus), "--tp", str(args.tp), "--stage", str(args.stage), "--results-file", str(results),
    ]
    for flag, value in (("--llama-layers", args.llama_layers), ("--llama-seq", args.llama_seq)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def run_config(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float]) -> None:
    run_once(args, config, results, out_dir, deadline, lambda f: worker_cmd(args, config, f),
             child_env(args, "lightning"), WORKER.name)


def meta(args: argparse.Namespace, command: str) -> dict[str, Any]:
    out = peers_meta(args, command)
    out["baseline"] = "gpt_mps"
    out["reference_comparable"] = False
    name, dims = llama_preset(args.llama, args.llama_layers, args.llama_seq)
    out["llama"] = {"name": name, "dims": dims, "micro_batch": args.llama_micro_batch}
    out["tp"], out["stage"] = args.tp, args.stage
    return out


def _pairs(records: list[dict[str, Any]], rows: list[Row]) -> str:
    """Per workload: ZeroStrategy over ModelParallelStrategy, tokens/s and peak memory."""
    by = {r.config: r for r in rows if r.status == "ok"}
    m = next((r for r in records if r.get("kind") == "meta"), {})
    llama = m.get("llama", {})
    lines = [f"Llama workload: {llama.get('name', '?')} {llama.get('dims', {})}, micro-batch {llama.get('micro_batch')} "
             f"per replica; tp {m.get('tp')}, ZeRO stage {m.get('stage')}.", "",
             "| workload | zero tokens/s | mps tokens/s | zero / mps | zero GiB | mps GiB |", "|---|---|---|---|---|---|"]
    for w in ("gpt", "llama"):
        z, p = by.get(f"{w}_zero"), by.get(f"{w}_mps")
        zt, pt = (z.tokens_per_s if z else None), (p.tokens_per_s if p else None)
        lines.append(f"| `{w}` | {_fmt(zt, ',.0f')} | {_fmt(pt, ',.0f')} | {_fmt(zt / pt if zt and pt else None, '.3f')} | "
                     f"{_fmt(z.peak_mem_gib if z else None, '.1f')} | {_fmt(p.peak_mem_gib if p else None, '.1f')} |")
    return "\n".join(lines)


def render_section(records: list[dict[str, Any]], configs: Optional[list[str]] = None) -> str:
    return render_gpt_section(records, configs, "tensor parallel vs ModelParallelStrategy",
        "the same TP plan under both strategies (gpt: MLPs split; llama: attention and MLP split); tokens counted "
        "once per data-parallel replica.", _pairs, TARGETS)


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv), argv, "tp", meta, run_config, render_section)


if __name__ == "__main__":
    sys.exit(main())
