"""The largest model that trains on one GPU without offload, per configuration (issue #33: 16-bit device states).

For each configuration a bisection over the depth of a GPT of width ``--d-model`` (GPT-2 vocabulary, seq 1024,
micro-batch 1, activation checkpointing on, bf16-mixed, AdamW): each try is one ``benchmarks/peers.py`` run of its
own process tree (1 warm-up + 2 timed steps), out-of-memory or any failure counts as "does not train". Prints a
markdown table: the deepest depth that trained, its parameter count, peak GPU memory and tokens/s, the first depth
that failed and why, and each configuration's largest model over the first configuration's (the issue's target:
16-bit states >= 1.8x the fp32-state largest).

    python3 benchmarks/largest.py --configs zero3:18:26,zero3_bf16sr:36:46,zero3_bf16sr_g16:44:56 --budget-s 500
    python3 benchmarks/largest.py --device cpu --d-model 64 --configs zero3:1:3 --step 1   # smoke

``NAME:LO:HI``: the depth range searched (LO expected to fit, HI expected not to; both are tried only when the
bisection gets there). ``--step``: the resolution of the answer in layers. One layer of width 4096 is 201M
parameters, so a resolution of 2 layers is ~4% at 10B. The estimator's predictions (``python -m lightning_zero.estimate
--params 5e9 --gpus 1 [--device-state-precision bf16_sr] [--grad-shard-precision bf16]``) print beside the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def n_params(layers: int, d: int, vocab: int = 50304, seq: int = 1024) -> int:
    """The example GPT's parameter count (tied embedding, biases, two LayerNorms a block and one at the end)."""
    block = 12 * d * d + 13 * d
    return layers * block + vocab * d + seq * d + 2 * d


def try_depth(args: argparse.Namespace, config: str, layers: int, work: Path, timeout: float) -> dict[str, Any]:
    """One peers.py run at ``layers`` deep: {'ok', 'reason', 'peak_gib', 'tokens_per_s', 'seconds'}."""
    yaml = work / f"gpt_{config}_{layers}.yaml"
    yaml.write_text(f"vocab_size: 50304\nn_layer: {layers}\nn_head: {max(1, args.d_model // 128)}\n"
                    f"d_model: {args.d_model}\nseq_len: {args.seq_len}\nactivation_checkpointing: true\n")
    out = work / f"{config}_{layers}"
    cmd = [sys.executable, str(HERE / "peers.py"), "--gpus", "1", "--configs", config, "--model", str(yaml),
           "--micro-batch", "1", "--steps", "2", "--warmup", "1", "--out-dir", str(out), "--device", args.device,
           "--config-timeout-s", str(int(timeout))]
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 60)
    seconds = time.monotonic() - t0
    records = []
    results = out / "results.jsonl"
    if results.is_file():
        records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    ranks = [r for r in records if r.get("kind") == "rank"]
    errors = [r for r in records if r.get("kind") == "error"]
    if ranks and not errors:
        r = ranks[0]
        steps = r.get("step_times_s") or [float("nan")]
        step = sorted(steps)[len(steps) // 2]
        return {"ok": True, "peak_gib": r["peak_mem_bytes"] / 2**30, "tokens_per_s": r["tokens_per_step_local"] / step,
                "seconds": seconds, "reason": ""}
    reason = " ".join(str(e.get("reason", "")) for e in errors) or (proc.stdout + proc.stderr)[-300:]
    if "out of memory" in reason.lower() or "outofmemory" in reason.lower():
        reason = "CUDA out of memory"
    return {"ok": False, "reason": reason.strip().replace("\n", " ")[:160], "seconds": seconds}


def search(args: argparse.Namespace, config: str, lo: int, hi: int, work: Path, deadline: float
           ) -> dict[str, Any]:
    """Bisection on depth in [lo, hi] at resolution ``args.step``; every try is kept for the table."""
    tries: dict[int, dict[str, Any]] = {}
    good: Optional[int] = None
    bad: Optional[int] = None
    probe = lo
    while True:
        left = deadline - time.monotonic()
        if left < args.min_try_s:
            break
        res = try_depth(args, config, probe, work, min(args.try_timeout_s, left))
        tries[probe] = res
        print(f"[{config}] {probe} layers ({n_params(probe, args.d_model) / 1e9:.2f}B): "
              f"{'ok' if res['ok'] else 'FAILED: ' + res['reason']} in {res['seconds']:.0f} s", flush=True)
        if res["ok"]:
            good = probe
        else:
            bad = probe
        if good is None:  # lo failed: go down
            if probe <= args.step:
                break
            probe = max(args.step, probe - 2 * args.step)
            continue
        upper = bad if bad is not None else hi + args.step
        if upper - good <= args.step:
            break
        probe = good + max(args.step, (upper - good) // 2 // args.step * args.step)
        if probe >= upper or probe in tries:
            break
    return {"config": config, "good": good, "bad": bad, "tries": tries}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="zero3:18:26,zero3_bf16sr:36:46,zero3_bf16sr_g16:44:56",
                   help="NAME:LO:HI,... (peers.py configuration names)")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--step", type=int, default=2, help="resolution in layers")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budget-s", type=float, default=520.0)
    p.add_argument("--try-timeout-s", type=float, default=150.0)
    p.add_argument("--min-try-s", type=float, default=40.0)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="lz_largest_"))
    found = []
    for spec in args.configs.split(","):
        name, lo, hi = spec.split(":")
        found.append(search(args, name, int(lo), int(hi), work, deadline))
    print(f"\n## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC · largest model without offload · 1 "
          f"{args.device} · GPT width {args.d_model}, seq {args.seq_len}, micro-batch 1, activation checkpointing\n")
    print("Command: `python3 benchmarks/largest.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`\n")
    print("| config | deepest that trained | parameters | peak GPU GiB | tokens/s | first that failed | why | "
          "largest / first row's |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    base = None
    for f in found:
        good, bad = f["good"], f["bad"]
        params = n_params(good, args.d_model) if good is not None else 0
        base = base or params or None
        ok = f["tries"].get(good, {}) if good is not None else {}
        why = f["tries"][bad]["reason"] if bad is not None else "(none failed in range)"
        ratio = f"{params / base:.2f}x" if base and params else "-"
        print(f"| `{f['config']}` | {good if good is not None else '-'} | {params / 1e9:.2f}B | "
              f"{ok.get('peak_gib', float('nan')):.1f} | {ok.get('tokens_per_s', float('nan')):,.0f} | "
              f"{bad if bad is not None else '-'} | {why} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
