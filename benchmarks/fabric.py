"""The same engines through both front doors, side by side, in one run (issue #18).

GPT-1.3B (``conf/model/gpt_1b.yaml``), micro-batch 8 per GPU, seq 1024, ``bf16-mixed``, torch
AdamW(fused=True), one process tree per configuration:

* the Trainer (peers_worker.py, unchanged): ``trainer_zero2``, ``trainer_zero3``, ``trainer_fsdp``,
  ``trainer_deepspeed_stage_3``;
* a hand-written Fabric loop (fabric_worker.py): ``fabric_zero2``, ``fabric_zero3``, ``fabric_fsdp``
  (FULL_SHARD, one unit per transformer block, meta-device init), ``fabric_deepspeed_stage_3``.

Each peer runs in its documented best configuration (fused AdamW, FSDP's transformer-block auto-wrap
policy). Targets, as same-run ratios: ``fabric_zero2`` and ``fabric_zero3`` >= 0.98x their Trainer
runs; ``fabric_zero3`` against Fabric's ``fsdp`` and ``deepspeed_stage_3`` at least the ratio the
Trainer shows against the Trainer's (both printed in the last table).

    python3 benchmarks/fabric.py --gpus 1 --budget-s 560            # ~9 min on one H100/H200
    python3 benchmarks/fabric.py --gpus 1 --configs trainer_zero3,fabric_zero3 --steps 20
    python3 benchmarks/fabric.py --device cpu --model gpt_tiny --gpus 1 --configs trainer_zero2,fabric_zero2,trainer_zero3,fabric_zero3 --steps 2 --warmup 1

As peers.py (whose run loop, process handling and table this reuses): one process tree per
configuration, this parent never imports torch, failures and timeouts become rows (a peer that
cannot be imported, e.g. DeepSpeed, is 'skipped'), ``--budget-s`` bounds the run and the table is
always printed.
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
from benchmarks.peers_report import (  # noqa: E402
    Row, Target, _fmt, render_gpt_section,
)

PEERS = ("zero2", "zero3", "fsdp", "deepspeed_stage_3")
ALL = [f"{door}_{peer}" for peer in PEERS for door in ("trainer", "fabric")]
"""Each peer through the Trainer, then through Fabric (pairs next to each other)."""
WORKERS = {"trainer": HERE / "peers_worker.py", "fabric": HERE / "fabric_worker.py"}
TARGETS: tuple[Target, ...] = tuple(
    Target(g, f"fabric_{p}", "tokens", f"trainer_{p}", 0.98, 18) for g in (1, 2) for p in ("zero2", "zero3")
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_args(p, ALL, steps=15, warmup=5)
    add_runner_args(p, config_timeout_s=240.0, min_config_s=45.0)
    args = p.parse_args(argv)
    select_configs(p, args, ALL, ALL)
    args.profile = False
    return args


def worker_cmd(args: argparse.Namespace, config: str, results: Path) -> list[str]:
    door, _, peer = config.partition("_")
    launch = worker_launch(args.gpus)
    return launch + [
        str(WORKERS[door]), "--config", peer if door == "trainer" else config, "--model", args.model,
        "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--device", args.device, "--devices", str(args.gpus), "--results-file", str(results),
    ]


def run_config(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float]) -> None:
    """A Trainer worker's records name its peer: they are renamed to this configuration."""
    worker = WORKERS[config.partition("_")[0]]
    run_once(args, config, results, out_dir, deadline, lambda f: worker_cmd(args, config, f),
             child_env(args, "lightning"), worker.name, stamp_config=True)


def meta(args: argparse.Namespace, command: str) -> dict[str, Any]:
    out = peers_meta(args, command)
    out["baseline"] = "trainer_zero3"
    return out


def _doors(rows: list[Row]) -> str:
    """Per peer: Fabric over Trainer tokens/s; then zero3 over each peer, through each door."""
    tok = {r.config: r.tokens_per_s for r in rows if r.status == "ok" and r.tokens_per_s}
    lines = ["| peer | Trainer tokens/s | Fabric tokens/s | Fabric / Trainer |", "|---|---|---|---|"]
    for peer in PEERS:
        t, f = tok.get(f"trainer_{peer}"), tok.get(f"fabric_{peer}")
        lines.append(f"| `{peer}` | {_fmt(t, ',.0f')} | {_fmt(f, ',.0f')} | {_fmt(f / t if t and f else None, '.3f')} |")
    lines += ["", "| zero3 over | through the Trainer | through Fabric | Fabric comparison at least the Trainer's |",
              "|---|---|---|---|"]
    for peer in ("fsdp", "deepspeed_stage_3"):
        ratios = []
        for door in ("trainer", "fabric"):
            z, p = tok.get(f"{door}_zero3"), tok.get(f"{door}_{peer}")
            ratios.append(z / p if z and p else None)
        ok = "–" if None in ratios else ("PASS" if ratios[1] >= ratios[0] * 0.98 else "FAIL")
        lines.append(f"| `{peer}` | {_fmt(ratios[0], '.3f')} | {_fmt(ratios[1], '.3f')} | {ok} |")
    return "\n".join(lines)


def render_section(records: list[dict[str, Any]], configs: Optional[list[str]] = None) -> str:
    return render_gpt_section(records, configs, "Trainer vs Fabric",
        "`fsdp` = FULL_SHARD, auto_wrap_policy={Block}.",
        lambda records, rows: _doors(rows), TARGETS)


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv), argv, "fabric", meta, run_config, render_section)


if __name__ == "__main__":
    sys.exit(main())
