"""ZeRO++'s quantize/dequantize work on one GPU (issue #33): the eager definition against the fused Triton
kernels (quant/triton_blocks.py [Note: fused quantize kernels]), at the shapes of the GPT-xl benchmark.

    python benchmarks/zeropp_kernels.py              # from the repository root, with it on PYTHONPATH

Per row: qwZ's quantize of a 25M-element bf16 shard (int8) and the dequantize of 2 such shards into a bf16
buffer; qgZ's quantize of a 50M-element fp32 bucket as 2 rows (int4) and the dequantize-and-sum of the
2 received rows. Milliseconds per call (CUDA events, median of 20 after 3 warm-ups), eager and fused.

A second table times qgZ's last step as stage 3 runs it, into a chunk of the fp32 gradient shard (divided
by the data-parallel size): the two steps it used to take (the fp32 mean into a new tensor, then copied
into the shard, or added to it under gradient accumulation) against the mean written (or added) straight
into the shard (comm/quantized.py [Note: qgZ into the gradient shard]), fused and eager; and hpZ's
two-level qgZ quantizing a bucket in its cross-node order: copied into it first, or read in place
(quant/triton_blocks.py [Note: no arranged copy]).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lightning_zero.comm.quantized import _dequantize_rows, _quantize_rows_eager
from lightning_zero.quant import triton_blocks as fused


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", type=int, default=25_000_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--block", type=int, default=2048)
    args = parser.parse_args()
    n, m, block = args.ranks, args.shard, args.block
    shard = torch.randn(1, m, device="cuda").bfloat16()
    bucket = torch.randn(n, m, device="cuda")
    out = torch.empty(n * m, dtype=torch.bfloat16, device="cuda")
    q8 = torch.cat([fused.quantize_rows(shard, 8, block)] * n)
    q4 = fused.quantize_rows(bucket, 4, block)
    rows = [
        ("qwZ quantize (int8, bf16 shard)", lambda: _quantize_rows_eager(shard, 8, block),
         lambda: fused.quantize_rows(shard, 8, block)),
        ("qwZ dequantize into bf16", lambda: out.view(n, m).copy_(_dequantize_rows(q8, n, m, 8, block)),
         lambda: fused.dequantize_rows_into(out, q8, n, m, 8, block)),
        ("qgZ quantize (int4, fp32 rows)", lambda: _quantize_rows_eager(bucket, 4, block),
         lambda: fused.quantize_rows(bucket, 4, block)),
        ("qgZ dequantize and sum", lambda: _dequantize_rows(q4, n, m, 4, block).sum(0),
         lambda: fused.dequantize_sum(q4, n, m, 4, block)),
    ]
    print(f"{torch.cuda.get_device_name()}: n={n} shard={m} block={block}")
    print("| work | eager ms | fused ms | speedup |\n|---|---|---|---|")
    for name, eager, fast in rows:
        te, tf = timed(eager), timed(fast)
        print(f"| {name} | {te:.3f} | {tf:.3f} | {te / tf:.1f}x |")
    grad_shard = torch.zeros(m + 1024, device="cuda")
    chunk = grad_shard[1024:]  # a bucket's chunk of the fp32 gradient shard, at an offset

    def eager_mean():
        return _dequantize_rows(q4, n, m, 4, block).sum(0).div_(n)

    def eager_direct():
        torch.sum(_dequantize_rows(q4, n, m, 4, block), 0, out=chunk).div_(n)

    into = [
        ("qgZ dequantize and sum into the fp32 shard (fused)",
         lambda: chunk.copy_(fused.dequantize_sum(q4, n, m, 4, block, n)),
         lambda: fused.dequantize_sum(q4, n, m, 4, block, n, out=chunk)),
        ("the same, added to the shard (accumulation, fused)",
         lambda: chunk.add_(fused.dequantize_sum(q4, n, m, 4, block, n)),
         lambda: fused.dequantize_sum(q4, n, m, 4, block, n, out=chunk, accumulate=True)),
        ("qgZ dequantize and sum into the fp32 shard (eager)", lambda: chunk.copy_(eager_mean()), eager_direct),
        ("hpZ's 2-node arrangement of a bucket, quantized (fused)",
         lambda: fused.quantize_rows(bucket.view(2, n, m // 2).transpose(0, 1).reshape(n, m), 4, block),
         lambda: fused.quantize_rows(bucket, 4, block, interleave=2)),
    ]
    print("\n| work | two steps (copy) ms | direct ms | speedup |\n|---|---|---|---|")
    for name, two, direct in into:
        tt, td = timed(two), timed(direct)
        print(f"| {name} | {tt:.3f} | {td:.3f} | {tt / td:.2f}x |")


if __name__ == "__main__":
    main()
