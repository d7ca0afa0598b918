"""The per-step merge of writes outside the optimizer (zero/merge_writes.py [Note: the merge's cost]): the eager
reference against the fused Triton kernel, on one GPU, over a shard cut into buckets as the strategy cuts it.

    python3 benchmarks/merge_writes.py --elements 2.06e9 --buckets 147   # an MoE rank of RESULTS.md 20:45

Prints one markdown row per path: ms per merge of the whole shard (median of ``--repeats``, after one warm-up),
and the bytes it moved per element at that speed's equivalent (the shard's 6 bytes of chunk + master read,
divided into the time, as GB/s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_zero.zero.merge_writes import fused_applies, merge_param_writes, merge_param_writes_reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=float, default=2.06e9)
    p.add_argument("--buckets", type=int, default=147)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n, k = int(args.elements), args.buckets
    master = torch.randn(n, device="cuda")
    live = master.to(torch.bfloat16)
    live[:: 1000] += 1  # a few changed elements, as after a clamp of one tensor
    edges = torch.linspace(0, n, k + 1).long().tolist()
    chunks = [(live[a:b], master[a:b]) for a, b in zip(edges, edges[1:])]
    assert all(fused_applies(lv, m) for lv, m in chunks)
    rows = []
    for name, fn in (("eager reference", merge_param_writes_reference), ("fused kernel", merge_param_writes)):
        times = []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for lv, m in chunks:
                fn(lv, m)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:]) * 1e3
        rows.append((name, ms, 6 * n / (ms / 1e3) / 1e9))
    print(f"## merge_writes · {torch.cuda.get_device_name()} · {n / 1e9:.2f}G elements in {k} buckets · "
          f"torch {torch.__version__}\n")
    print("| path | ms per merge | chunk + master read, GB/s equivalent |\n|---|---:|---:|")
    for name, ms, gbs in rows:
        print(f"| {name} | {ms:.2f} | {gbs:.0f} |")
    print(f"\nfused / eager: {rows[1][1] / rows[0][1]:.3f}x the time")


if __name__ == "__main__":
    main()
