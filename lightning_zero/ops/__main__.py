"""``python -m lightning_zero.ops report|build [--ops a,b] [--verbose]``.

report: the toolchain, then a table of every op (runs here, builds here,
built, where from, why not and what runs instead), then which ops this machine
runs compiled; it never compiles anything. build: JIT-build every compatible
op now (e.g. in a Docker image), so that later runs need no compiler and can
set LIGHTNING_ZERO_DISABLE_JIT=1; exits 1 if a compatible op fails to build.
CUDA ops are skipped, in one line, on a machine without a usable CUDA device
(nothing there would run them, and compiling them takes minutes); ``--with-cuda``
builds them anyway (an image prepared on a CPU machine for GPU hosts).
"""

from __future__ import annotations

import argparse
import sys

from lightning_zero.ops.registry import OPS
from lightning_zero.ops.report import build_all, environment_lines, render_table, summary_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero.ops", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["report", "build"])
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--verbose", action="store_true", help="show compiler commands and output")
    parser.add_argument("--with-cuda", action="store_true",
                        help="build: compile CUDA ops even without a usable CUDA device here")
    args = parser.parse_args(argv)
    names = [n for n in args.ops.split(",") if n] or list(OPS)
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; known: {sorted(OPS)}")
    ops = [OPS[n] for n in names]
    for line in environment_lines():
        print(line)
    print()
    if args.command == "build":
        idle = [op.name for op in ops if op.device == "cuda" and not op.device_present()]
        if idle and not args.with_cuda:
            print(f"skipping the CUDA ops {', '.join(idle)}: no usable CUDA device here (--with-cuda builds them anyway)")
        built = [op for op in ops if args.with_cuda or op.name not in idle]
        results = build_all(built, verbose=args.verbose)
        for name, outcome in results:
            print(f"{name}: {outcome}")
        print()
        _print_table(ops)
        return 1 if any(outcome.startswith("FAILED") for _, outcome in results) else 0
    _print_table(ops)
    return 0


def _print_table(ops: list) -> None:
    rows = [op.status() for op in ops]
    print(render_table(rows))
    print()
    for line in summary_lines(rows):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
