"""Benchmark of the host Adam state precisions (lightning_zero/optim/host_states.py) on the CPU.

    python benchmarks/host_states.py                        # 16M params, all cores
    python benchmarks/host_states.py --numel 200000000      # the GPU machine's host (16 cores)
    python benchmarks/host_states.py --reference            # also time the pure-torch fallback (small)

One step of each precision through ``host_states.step`` (bf16 gradients in, bf16 compute copy out,
AdamW), median of the timed steps, beside the fp32 layout (today's ``cpu_adam`` op) in the same run.
Prints a markdown table: host bytes per parameter, ms per step, the ratio to fp32, and the host
memory traffic the step implies (state read + written, 2 B gradient in, 2 B copy out) per second.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from lightning_zero.offload.cpu import AdamHyper  # noqa: E402
from lightning_zero.optim.host_states import PRECISIONS, HostAdamState, bytes_per_param, load_host_op, step  # noqa: E402

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)


def time_steps(precision: str, numel: int, threads: int, warmup: int, iters: int, use_op: bool) -> float:
    state = HostAdamState.zeros(numel, precision)  # type: ignore[arg-type]
    state.import_fp32(torch.randn(numel) * 0.02)
    grad = (torch.randn(numel) * 1e-2).bfloat16()
    out16 = torch.empty(numel, dtype=torch.bfloat16)
    op = load_host_op(precision) if use_op else None  # type: ignore[arg-type]
    if use_op and op is None:
        raise SystemExit(f"the compiled op for {precision} is unavailable: see `python -m lightning_zero.ops report`")
    samples = []
    for k in range(1, warmup + iters + 1):
        start = time.perf_counter()
        step(op, state, grad, out16, k, HYPER, threads=threads)
        if k > warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--threads", type=int, default=0, help="0: all of torch's threads")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--reference", action="store_true", help="also time the pure-torch fallback at 1/16 size")
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    print(f"host state step, {args.numel / 1e6:.1f}M params, {threads} threads, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {datetime.date.today()}\n")
    print("| precision | path | B/param | ms/step | vs fp32 op | GB/s (implied traffic) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = [(p, True, args.numel) for p in PRECISIONS]
    if args.reference:
        rows += [(p, False, args.numel // 16) for p in PRECISIONS if p != "fp32"]
    base = None
    for precision, use_op, numel in rows:
        ms = time_steps(precision, numel, threads, args.warmup, args.iters, use_op)
        if precision == "fp32" and use_op:
            base = ms
        bpp = bytes_per_param(precision)  # type: ignore[arg-type]
        traffic = (2 * bpp + 4) * numel / (ms * 1e-3) / 1e9
        ratio = f"{base / ms * numel / args.numel:.2f}x" if base else "-"
        path = "compiled op" if use_op else f"pure-torch reference ({numel / 1e6:.1f}M)"
        print(f"| {precision} | {path} | {bpp:g} | {ms:.2f} | {ratio} | {traffic:.1f} |", flush=True)
    print("\nvs fp32 op: fp32 time / this time (per parameter for the reference rows); > 1 is faster.")


if __name__ == "__main__":
    main()
