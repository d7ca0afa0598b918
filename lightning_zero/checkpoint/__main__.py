"""``python -m lightning_zero.checkpoint {consolidate,inspect}``: sharded checkpoints, offline.

    python -m lightning_zero.checkpoint inspect  'checkpoints/epoch=0-step=500.ckpt'
    python -m lightning_zero.checkpoint consolidate 'checkpoints/epoch=0-step=500.ckpt' model.ckpt
    python -m lightning_zero.checkpoint consolidate 'checkpoints/epoch=0-step=500.ckpt' model.safetensors --safetensors

No GPU and no process group are needed; consolidation holds the full weights (and, without
``--safetensors``, the full optimizer state) in host memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from lightning_zero.checkpoint.consolidate import consolidate, default_output, describe
from lightning_zero.checkpoint.storage import CorruptCheckpointError


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one ordinary Lightning checkpoint (or safetensors) file")
    c.add_argument("src", help="a sharded checkpoint directory")
    c.add_argument("out", nargs="?", help="output file (default: next to SRC)")
    c.add_argument("--safetensors", action="store_true", help="write the weights alone, as safetensors")
    c.add_argument("--no-progress", action="store_true")
    i = sub.add_parser("inspect", help="print what a sharded checkpoint holds")
    i.add_argument("src")
    i.add_argument("--tensors", action="store_true", help="list every weight with its shape and dtype")
    args = parser.parse_args(argv)
    if not Path(args.src).exists():
        print(f"error: {args.src} does not exist", file=sys.stderr)
        return 1
    try:
        if args.command == "inspect":
            print(describe(args.src, list_tensors=args.tensors))
            sys.stdout.flush()
            return 0
        out = args.out or default_output(args.src, args.safetensors)
        written = consolidate(args.src, out, safetensors=args.safetensors, progress=not args.no_progress)
        print(f"wrote {written}")
        return 0
    except (CorruptCheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `inspect ... | head`: the reader left; end quietly (Python's documented recipe)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
