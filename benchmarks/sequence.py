"""Long-context figures of issue #30: the longest sequence one GPU trains, and sequence-parallel tokens/s
against DeepSpeed's Ulysses/ALST, on an HF Llama of Llama-3-8B's shape (random weights, bf16, AdamW).

    python3 benchmarks/sequence.py longest --plan-only                 # what this machine can hold, no run
    python3 benchmarks/sequence.py longest --budget-s 480              # search the longest S on one GPU
    python3 benchmarks/sequence.py longest --seq-lens 128K,256K --steps 1
    python3 benchmarks/sequence.py longest --layers 4 --seq-lens 256K,512K   # shallow, fast
    python3 benchmarks/sequence.py sp --gpus 4 --seq-lens 32K,128K --profile --peak-tflops 989
    python3 benchmarks/sequence.py sp --device cpu --gpus 2 --model tiny --seq-lens 256   # CPU smoke (seconds)
    python3 benchmarks/sequence.py longest --device cpu --model tiny --seq-lens 256,512   # CPU smoke

``longest``: each try (one sequence length) is its own process (``sequence_worker.py --mode longest``):
``zero3_offload`` with ``offload_state_precision='bf16_sr'``, tiled MLPs, the chunked loss, every layer
checkpointed, the checkpoints of as many layers as host memory holds offloaded to it and the rest kept on
the GPU (sequence_plan.py [Note: the long-sequence ceiling of one machine]). Before any try the plan is
printed: host and GPU memory, the offload states, the planned ceiling and its limit, the absolute bound.
The search starts at the planned ceiling (or ``--start``), grows by ``--growth`` while tries succeed and
bisects down to ``--resolution`` once one fails, never past the absolute bound, within ``--budget-s``
(a try whose estimated time no longer fits is not started). A GPU out-of-memory error, a host refusal or a
process the kernel killed is a row with its status; the table is always printed.

``sp``: for each sequence length, ``ours`` (``ZeroStrategy(stage=3, sequence_parallel=N, tiled_mlp=T)``,
chunked loss, every layer checkpointed) then ``deepspeed`` (sequence_ds.py: DeepSpeed's ALST recipe used
directly), each in its own ``torchrun --nproc-per-node N``; tokens/s (the mean of the steps after the first),
MFU against ``--peak-tflops``, peak GPU memory, and with ``--profile`` the NCCL and SP-exchange shares of one
more profiled step. A peer that cannot run is a row "not run: <reason>"; ours are never lost to it.

Every table is headed by the device, the date, the command and the versions; rows and the table are written
under ``--out-dir`` (``results.jsonl``, ``table.md``). This parent imports no torch at start (the plan
imports lightning_zero's estimator on the CPU only).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from benchmarks.peers import SAFE_ENV, dist_version, nvidia_smi, reap_workers, reason_from_tail, run_child, worker_launch  # noqa: E402
from benchmarks.presets import llama_preset  # noqa: E402
from benchmarks.sequence_plan import (  # noqa: E402
    GIB, absolute_bound, ceiling, flops_per_token, offload_state_bytes, plan, step_seconds,
)

WORKERS = {"ours": HERE / "sequence_worker.py", "deepspeed": HERE / "sequence_ds.py"}
SETUP_S = 90.0
"""Planning figure: seconds a try spends before its first step (imports, 8B model built and offloaded)."""


def tokens(text: str) -> int:
    """``131072``, ``128K`` or ``1M`` -> tokens (K = 1024)."""
    t = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


def fmt_tokens(n: int) -> str:
    """``131072`` -> ``128K``; lengths that are not whole K are shown to the token below 1K, else rounded."""
    if n < 1024:
        return str(n)
    return f"{n // 1024}K" if n % 1024 == 0 else f"~{n / 1024:.0f}K"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("longest", "sp"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="8b", help="llama_8b/8b or llama_tiny/tiny")
        s.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
        s.add_argument("--seq-lens", default=None, help="comma-separated lengths (128K, 262144); longest: no search")
        s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        s.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU for MFU (H100/H200: 989)")
        s.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
        s.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per chunk of the loss (both peers)")
        s.add_argument("--out-dir", type=Path, default=None, help="default: runs/sequence/<date>-<time>")
    lo = sub.choices["longest"]
    lo.add_argument("--steps", type=int, default=1, help="optimizer steps per try (the last is reported)")
    lo.add_argument("--state-precision", default="bf16_sr", help="offload_state_precision (fp32 needs 120 GiB at 8B)")
    lo.add_argument("--start", default=None, help="first length of the search (default: the planned ceiling)")
    lo.add_argument("--growth", type=float, default=1.125, help="factor between tries until one fails")
    lo.add_argument("--resolution", default="16K", help="stop bisecting when the gap is this small")
    lo.add_argument("--max-tries", type=int, default=6)
    lo.add_argument("--max-seq", default=None, help="longest length the search tries (default: the absolute bound)")
    lo.add_argument("--try-timeout-s", type=float, default=590.0)
    lo.add_argument("--gpu-ckpt-layers", default="auto", help="layers checkpointed on the GPU (auto: what the host cannot hold)")
    lo.add_argument("--host-margin-gib", type=float, default=8.0, help="host memory the plan leaves free")
    lo.add_argument("--host-gib", type=float, default=None, help="plan for this host memory (default: this machine's)")
    lo.add_argument("--gpu-gib", type=float, default=None, help="plan for this GPU memory (default: nvidia-smi's)")
    lo.add_argument("--pow2-pinned", action="store_true", help="plan as if pinned blocks round to powers of two")
    lo.add_argument("--plan-only", action="store_true", help="print the plan and exit")
    sp = sub.choices["sp"]
    sp.add_argument("--gpus", type=int, default=4, help="sequence-parallel degree (= processes)")
    sp.add_argument("--configs", default="ours,deepspeed", help="ours, deepspeed")
    sp.add_argument("--steps", type=int, default=3, help="steps per configuration (the first is warm-up)")
    sp.add_argument("--attention", default="auto", help="ours: sequence_attention (auto, ulysses, ring)")
    sp.add_argument("--profile", action="store_true", help="profile one more step: NCCL and SP-exchange shares")
    sp.add_argument("--config-timeout-s", type=float, default=420.0)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    llama_preset(args.model, args.layers)  # an unknown preset fails here
    return args


# ---------------------------------------------------------------------------------------------------- shared


def header(args: argparse.Namespace) -> list[str]:
    device = (nvidia_smi("name") or "GPU") if args.device == "cuda" else "CPU (gloo)"
    gpu_mem = nvidia_smi("memory.total") if args.device == "cuda" else None
    host = host_total_bytes()
    vers = ", ".join(f"{d} {dist_version(d)}" for d in ("torch", "lightning", "transformers", "deepspeed")
                     if dist_version(d))
    return [f"Device: {device}{f' ({gpu_mem})' if gpu_mem else ''}, host {host / GIB:.1f} GiB, "
            f"{os.cpu_count()} cores; {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"Command: `python3 benchmarks/sequence.py {shlex.join(args.argv)}`", f"Versions: {vers}"]


def host_total_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def child_env(args: argparse.Namespace, family: str, procs: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # ALST's advice, for both peers
    if family == "deepspeed" and args.device == "cuda":
        env["TORCH_CUDA_ARCH_LIST"] = nvidia_smi("compute_cap") or "9.0"  # DeepSpeed's op builder rejects "9.0a"
    return env


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(args: argparse.Namespace, family: str, procs: int, worker_args: list[str], results: Path,
           out_dir: Path, timeout: float, label: str) -> tuple[list[dict[str, Any]], float]:
    """One worker run; returns its rows (an error row of its own when the worker wrote none) and seconds."""
    before = len(read_rows(results))
    cmd = worker_launch(procs) + [str(WORKERS[family])] + worker_args + ["--results-file", str(results)]
    res = run_child(cmd, child_env(args, family, procs), out_dir / "log.txt", timeout, f"[{label}] ")
    reap_workers(results.with_suffix(".pids"), WORKERS[family].name)
    rows = read_rows(results)[before:]
    if not any(r.get("kind") == "rank" for r in rows) and not rows:
        status = "killed (host OOM?)" if res.returncode in (-9, 137) and not res.timed_out else (
            "timeout" if res.timed_out else "failed")
        row = {"kind": "error", "status": status, "reason": reason_from_tail(res), "rank": 0}
        with results.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        rows = [row]
    return rows, res.seconds


def steady(times: list[float]) -> float:
    """The mean of the steps after the first (the only one when there is one)."""
    return sum(times[1:]) / len(times[1:]) if len(times) > 1 else times[0]


def gib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GIB:.1f}"


# ---------------------------------------------------------------------------------------------------- longest


def machine(args: argparse.Namespace) -> tuple[float, float]:
    """(host bytes, GPU bytes) to plan for."""
    host = args.host_gib * GIB if args.host_gib else float(host_total_bytes())
    if args.gpu_gib:
        gpu = args.gpu_gib * GIB
    else:
        text = nvidia_smi("memory.total") if args.device == "cuda" else None  # "81559 MiB"
        gpu = float(text.split()[0]) * 2**20 if text else 80 * 10**9
    return host, gpu


def plan_lines(args: argparse.Namespace, dims: dict[str, int]) -> tuple[list[str], int, int]:
    """The printed plan, the planned ceiling and the absolute bound."""
    host, gpu = machine(args)
    states = offload_state_bytes(dims, args.state_precision)
    free = host - states - args.host_margin_gib * GIB
    per_tok = dims["num_hidden_layers"] * 2 * dims["hidden_size"]
    exact, pow2 = ceiling(dims, free, gpu, pow2=False), ceiling(dims, free, gpu, pow2=True)
    chosen = pow2 if args.pow2_pinned else exact
    bound = absolute_bound(dims, free, gpu)
    host_only = int(free // per_tok)
    peak = args.peak_tflops * 1e12
    lines = [
        f"Plan ({dims['num_hidden_layers']} layers, hidden {dims['hidden_size']}): host {host / GIB:.1f} GiB, "
        f"GPU {gpu / GIB:.1f} GiB; offload states ({args.state_precision}) {states / GIB:.1f} GiB, margin "
        f"{args.host_margin_gib:.0f} GiB -> {free / GIB:.1f} GiB of host memory for layer checkpoints.",
        f"Layer checkpoints: {per_tok // 1024} KiB per token ({dims['num_hidden_layers']} layers x 2 x "
        f"{dims['hidden_size']} B): the host alone holds {fmt_tokens(host_only)} tokens' worth; longer sequences "
        "keep the remaining layers' checkpoints on the GPU beside a working set of ~"
        f"{(plan(dims, 1024, free, gpu, False).gpu_bytes - 6 * GIB) / 1024 / 1024:.0f} KiB per token.",
        f"Planned ceiling: {fmt_tokens(exact.seq_len)} with exact pinned blocks ({exact.host_layers} layers' "
        f"checkpoints on the host, {exact.gpu_layers} on the GPU, ~{exact.gpu_bytes / GIB:.0f} GiB of GPU); "
        f"{fmt_tokens(pow2.seq_len)} if pinned blocks round to powers of two. Limit: host memory for the "
        "checkpoints, then GPU memory for the rest (both full at the ceiling).",
        f"Absolute bound (checkpoints alone filling the free host memory and the whole GPU): {fmt_tokens(bound)}; "
        f"fp32 offload states would leave {(host - offload_state_bytes(dims, 'fp32') - args.host_margin_gib * GIB) / GIB:.0f} GiB.",
        f"Estimated step at the ceiling: ~{step_seconds(dims, chosen.seq_len, peak):.0f} s "
        f"(executed FLOPs at 45% of {args.peak_tflops:.0f} TFLOP/s) + ~{SETUP_S:.0f} s set-up per try.",
    ]
    return lines, chosen.seq_len, bound


def worker_args_longest(args: argparse.Namespace, seq: int) -> list[str]:
    out = ["--mode", "longest", "--model", args.model, "--seq-len", str(seq), "--steps", str(args.steps),
           "--device", args.device, "--state-precision", args.state_precision, "--chunk-tokens", str(args.chunk_tokens),
           "--gpu-ckpt-layers", str(args.gpu_ckpt_layers), "--host-margin-gib", str(args.host_margin_gib),
           "--config", f"ours_{fmt_tokens(seq)}"]
    return out + (["--layers", str(args.layers)] if args.layers else [])


def next_length(ok: list[int], bad: list[int], last: int, growth: float, resolution: int, bound: int) -> Optional[int]:
    """The search: grow while tries succeed, shrink while they fail, then bisect; None when done."""
    lo, hi = max(ok, default=None), min(bad, default=None)
    if hi is None:
        nxt = int(last * growth) // resolution * resolution
        return nxt if lo is not None and lo < nxt <= bound else None
    if lo is None:
        nxt = int(last / growth) // resolution * resolution
        return nxt if 0 < nxt < hi else None
    if hi - lo <= resolution:
        return None
    return (lo + hi) // 2 // resolution * resolution or None


def run_longest(args: argparse.Namespace, out_dir: Path, results: Path) -> list[str]:
    _, dims = llama_preset(args.model, args.layers)
    if args.device == "cpu" and not (args.plan_only or args.host_gib or args.gpu_gib):
        lines, planned, bound = ["CPU smoke run: no memory plan (it is a GPU machine's)."], 1024, 1 << 30
    else:
        lines, planned, bound = plan_lines(args, dims)
    print("\n".join(lines), flush=True)
    if args.plan_only:
        return lines
    resolution = tokens(args.resolution)
    bound = min(bound, tokens(args.max_seq)) if args.max_seq else bound
    fixed = [tokens(s) for s in args.seq_lens.split(",")] if args.seq_lens else None
    seq = fixed[0] if fixed else (tokens(args.start) if args.start else planned)
    deadline = time.monotonic() + args.budget_s
    ok: list[int] = []
    bad: list[int] = []
    rows: list[tuple[int, list[dict[str, Any]]]] = []
    costs: list[tuple[int, float]] = []  # (length, seconds of its try)
    def estimate(n: int) -> float:
        return SETUP_S + args.steps * step_seconds(dims, n, args.peak_tflops * 1e12) if args.device == "cuda" else 30.0

    if not fixed and not args.start and estimate(seq) > args.budget_s:  # memory allows more than time does
        first = seq
        while seq > resolution and estimate(seq) > args.budget_s:
            seq -= resolution
        note = (f"The planned ceiling {fmt_tokens(first)} needs ~{estimate(first):.0f} s, over --budget-s "
                f"{args.budget_s:.0f}: the search starts at {fmt_tokens(seq)}, the longest whose try fits it.")
        print(note, flush=True)
        lines.append(note)
    while seq is not None and len(rows) < (len(fixed) if fixed else args.max_tries):
        left = deadline - time.monotonic()
        guess = estimate(seq)
        if costs:  # scale the slowest try seen by the step's quadratic growth
            s0, t0 = max(costs, key=lambda c: c[1])
            guess = max(guess * 0.5, t0 * (seq / s0) ** 2 if seq > s0 else t0 * 0.5)
        if guess > left:
            print(f"[longest] {fmt_tokens(seq)} not tried: ~{guess:.0f} s needed, {max(0.0, left):.0f} s left", flush=True)
            rows.append((seq, [{"kind": "error", "status": "skipped", "reason": f"out of budget (~{guess:.0f} s needed)"}]))
            break
        got, seconds = launch(args, "ours", 1, worker_args_longest(args, seq), results, out_dir,
                              min(args.try_timeout_s, left), f"longest {fmt_tokens(seq)}")
        costs.append((seq, seconds))
        rows.append((seq, got))
        (ok if any(r.get("kind") == "rank" for r in got) else bad).append(seq)
        if fixed:
            seq = fixed[len(rows)] if len(rows) < len(fixed) else None
        else:
            seq = next_length(ok, bad, seq, args.growth, resolution, bound)
    return lines + [""] + longest_table(args, dims, rows, ok)


def longest_table(args: argparse.Namespace, dims: dict[str, int], rows: list[tuple[int, list[dict[str, Any]]]],
                  ok: list[int]) -> list[str]:
    out = ["| tokens | status | s/step | tokens/s | MFU | peak GPU GiB (alloc / reserved) | GPU KiB per token beside "
           "the checkpoints | peak RSS GiB | host used peak GiB | ckpt layers GPU / host | tiles | pinned |",
           "|" + " --- |" * 12]
    for seq, got in rows:
        rank = next((r for r in got if r.get("kind") == "rank"), None)
        if rank is None:
            err = got[0] if got else {}
            out.append(f"| {fmt_tokens(seq)} | {err.get('status', 'failed')}: {str(err.get('reason', ''))[:160]} |"
                       + " - |" * 10)
            continue
        step = rank["step_times_s"][-1]
        mfu = seq * flops_per_token(dims, seq) / step / (args.peak_tflops * 1e12) if args.device == "cuda" else None
        applied = rank.get("applied", {})
        peak = rank.get("peak_gpu_bytes")  # what the planning figure GPU_BYTES_PER_TOKEN stands for, measured:
        beside = None if peak is None else (peak - rank["gpu_ckpt_layers"] * 2 * dims["hidden_size"] * seq) / seq / 1024
        out.append(
            f"| {fmt_tokens(seq)} | ok (step {len(rank['step_times_s'])}) | {step:.1f} | {seq / step:,.0f} | "
            f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {gib(rank.get('peak_gpu_bytes'))} / "
            f"{gib(rank.get('peak_gpu_reserved_bytes'))} | {'-' if beside is None else f'{beside:.0f}'} | "
            f"{gib(rank.get('peak_rss_bytes'))} | "
            f"{gib(rank.get('host_used_peak_bytes'))} | {rank['gpu_ckpt_layers']} / {applied.get('offloaded', '?')} | "
            f"{rank['tiles']} | {rank['pinned_rounding']} |")
    best = max(ok, default=None)
    out.append("")
    out.append(f"Longest sequence that trained: {fmt_tokens(best) if best else 'none'} tokens "
               f"({dims['num_hidden_layers']} layers; loss = token mean of the chunked cross-entropy; the step "
               f"reported is the last of {args.steps}, the first includes warm-up).")
    return out


# ---------------------------------------------------------------------------------------------------- sp


def worker_args_sp(args: argparse.Namespace, family: str, seq: int) -> list[str]:
    out = ["--mode", "sp", "--model", args.model, "--seq-len", str(seq), "--steps", str(args.steps),
           "--device", args.device, "--devices", str(args.gpus), "--chunk-tokens", str(args.chunk_tokens),
           "--config", family]
    if family == "ours":
        out += ["--attention", args.attention]
    else:
        out = [a for a in out if a != "--mode" and a != "sp"]
    return out + (["--layers", str(args.layers)] if args.layers else []) + (["--profile"] if args.profile else [])


def run_sp(args: argparse.Namespace, out_dir: Path, results: Path) -> list[str]:
    _, dims = llama_preset(args.model, args.layers)
    families = [c for c in args.configs.split(",") if c]
    unknown = [c for c in families if c not in WORKERS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; valid: {list(WORKERS)}")
    deadline = time.monotonic() + args.budget_s
    table = [f"SP {args.gpus}, zero3, {dims['num_hidden_layers']} layers, bf16, AdamW, batch 1; tokens/s = sequence / "
             f"step (mean of steps 2..{args.steps}); MFU vs {args.peak_tflops:.0f} TFLOP/s per GPU "
             "(6 x matmul params + 12 x layers x hidden x S per token, recomputation not counted)", "",
             "| tokens | config | tokens/s | vs deepspeed | MFU | peak GPU GiB | NCCL share (exposed / total) | "
             "SP exchange share (exposed / total) | notes |", "|" + " --- |" * 9]
    for text in (args.seq_lens or "32K,128K").split(","):
        seq = tokens(text)
        by_family: dict[str, Optional[float]] = {}
        lines: list[str] = []
        for family in families:
            left = deadline - time.monotonic()
            if left < 30:
                lines.append(f"| {fmt_tokens(seq)} | {family} | not run: out of budget |" + " - |" * 6)
                continue
            got, _ = launch(args, family, args.gpus, worker_args_sp(args, family, seq), results, out_dir,
                            min(args.config_timeout_s, left), f"{family} {fmt_tokens(seq)}")
            ranks = [r for r in got if r.get("kind") == "rank"]
            if not ranks:
                err = got[0]
                lines.append(f"| {fmt_tokens(seq)} | {family} | not run: {err.get('status')}: "
                             f"{str(err.get('reason', ''))[:160]} |" + " - |" * 6)
                by_family[family] = None
                continue
            step = max(steady(r["step_times_s"]) for r in ranks)  # the group's step is its slowest rank's
            tps = seq / step
            by_family[family] = tps
            mfu = tps * flops_per_token(dims, seq) / args.gpus / (args.peak_tflops * 1e12) if args.device == "cuda" else None
            comm = ranks[0].get("comm") or {}
            lines.append((family, tps, mfu, max(r.get("peak_gpu_bytes") or 0 for r in ranks), comm, ranks[0]))  # type: ignore[arg-type]
        ds = by_family.get("deepspeed")
        for line in lines:
            if isinstance(line, str):
                table.append(line)
                continue
            family, tps, mfu, peak, comm, rank = line  # type: ignore[misc]
            ratio = f"{tps / ds:.2f}x" if ds else "-"
            share = lambda k: "-" if comm.get(f"{k}_fraction") is None else (  # noqa: E731
                f"{100 * comm[f'{k}_exposed_fraction']:.1f}% / {100 * comm[f'{k}_fraction']:.1f}%")
            note = rank.get("notes") or (f"attention {rank.get('attention')}, tiles {rank.get('tiles')}"
                                         if family == "ours" else "")
            if comm.get("note"):
                note += f"; {comm['note']}"
            table.append(f"| {fmt_tokens(seq)} | {family} | {tps:,.0f} | {ratio} | "
                         f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {gib(peak) if peak else '-'} | {share('nccl')} | {share('sp')} | {note} |")
    return table


# ---------------------------------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir or REPO / "runs" / "sequence" / dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    head = header(args)
    print("\n".join(head), flush=True)
    body = run_longest(args, out_dir, results) if args.what == "longest" else run_sp(args, out_dir, results)
    text = "\n".join(head + [""] + body) + "\n"
    (out_dir / "table.md").write_text(text)
    print("\n" + text, flush=True)
    print(f"rows: {results}\ntable: {out_dir / 'table.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
