"""What a large device-to-host copy on a side stream costs the training stream beside it (one GPU).

[Note: copy-engine contention]
An async save copies each rank's states (21 GiB at the 8B shape on 4 GPUs) to pinned host memory on a
side stream. On 4 H200s (2026-11-29 20:16) the first training step after the save took 0.35 s longer
than the others, about the copy's own duration, although nothing in the step waits for the side
stream. Two suspects: (a) a small device-to-host copy in the step (a ``.item()``, a logged loss) queued
behind the big copy on the same copy engine; (b) the caching allocator releasing cached blocks
(``cudaFree``, which synchronises the device) because the snapshot took the blocks the step needed.
This times, with a ``--gib`` copy in flight on a side stream: a 4-byte ``.item()`` on the training
stream, a small host-to-device copy, a compute-only kernel, and ``torch.cuda.empty_cache()``; then
the same ``.item()`` while a host thread issues the copy in ``--chunk-mib`` pieces, at most
``--in-flight`` outstanding, which bounds how long a small copy can queue (and what that costs the
big copy's bandwidth).

    python3 benchmarks/d2h_contention.py --gib 16 --chunk-mib 64 --in-flight 2
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def whole(src: torch.Tensor, dst: torch.Tensor, side: torch.cuda.Stream) -> torch.cuda.Event:
    """The copy as one call on the side stream."""
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return done


def chunked(src: torch.Tensor, dst: torch.Tensor, side: torch.cuda.Stream, chunk: int,
            in_flight: int) -> threading.Thread:
    """The copy issued from a host thread in ``chunk``-byte pieces, at most ``in_flight`` outstanding."""

    def issue() -> None:
        pending: list[torch.cuda.Event] = []
        with torch.cuda.stream(side):
            for at in range(0, src.numel(), chunk):
                if len(pending) >= in_flight:
                    pending.pop(0).synchronize()
                dst[at : at + chunk].copy_(src[at : at + chunk], non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
                pending.append(event)
        for event in pending:
            event.synchronize()

    thread = threading.Thread(target=issue)
    thread.start()
    return thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda")
    n = int(args.gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream(device)
    scalar = torch.ones((), device=device)
    small_host = torch.ones(1 << 20, pin_memory=True)
    a = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()

    def item() -> None:
        scalar.item()

    def h2d() -> None:
        small_host.to(device, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def compute() -> None:
        (a @ a).sum()
        torch.cuda.current_stream().synchronize()

    rows: list[tuple[str, float, float]] = []
    copy_s = timed(lambda: whole(src, dst, side).synchronize())
    rows.append(("the copy alone (one call)", copy_s, n / copy_s / 1e9))
    for name, probe in (("`.item()` on the training stream", item), ("1 MiB host-to-device + sync", h2d),
                        ("2048^3 matmul + sync", compute), ("`torch.cuda.empty_cache()`", torch.cuda.empty_cache)):
        probe()
        idle = timed(probe)
        done = whole(src, dst, side)
        time.sleep(0.002)
        busy = timed(probe)
        done.synchronize()
        rows.append((f"{name}: idle / with the copy in flight", idle, busy))
    chunk = args.chunk_mib << 20
    t0 = time.perf_counter()
    thread = chunked(src, dst, side, chunk, args.in_flight)
    time.sleep(0.01)
    waits = []
    while thread.is_alive():
        waits.append(timed(item))
        time.sleep(0.005)
    thread.join()
    total = time.perf_counter() - t0
    rows.append((f"chunked ({args.chunk_mib} MiB, {args.in_flight} in flight): copy s / GB/s", total, n / total / 1e9))
    rows.append(("chunked: `.item()` worst / median during the copy", max(waits, default=0.0),
                 sorted(waits)[len(waits) // 2] if waits else 0.0))
    print(f"## d2h_contention · {torch.cuda.get_device_name(device)} · {args.gib} GiB · torch {torch.__version__}\n")
    print("| measurement | a | b |\n|---|---|---|")
    for name, x, y in rows:
        print(f"| {name} | {x:.6f} | {y:.6f} |")


if __name__ == "__main__":
    main()
