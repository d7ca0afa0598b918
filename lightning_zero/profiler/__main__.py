"""``python -m lightning_zero.profiler MODULE:CLASS``: a one-off flops profile of a model class.

Builds the class with ``--kwargs`` (JSON) and ``--yaml-arg NAME=FILE`` (a YAML file as one keyword
argument, e.g. ``--yaml-arg model=conf/model/gpt_small.yaml`` for the example GPTModule), runs one
warm-up and one profiled forward (and backward of the output's sum, unless ``--no-backward``) on an
input given by ``--input`` (``2x128:long``: shape and dtype; integer inputs are random ids below
``--vocab``) or, when omitted, the module's ``example_input_array``, and prints the report
(report.py). Example::

    python -m lightning_zero.profiler examples.gpt:GPTModule --yaml-arg model=conf/model/gpt_small.yaml \\
        --input 4x128:long --depth 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any, Optional

import torch

from lightning_zero.logging.metrics import peak_bf16_flops
from lightning_zero.profiler.modules import ModuleProfiler
from lightning_zero.profiler.report import StepTotals, render

DTYPES = {"long": torch.long, "int": torch.int, "float": torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "half": torch.float16, "float16": torch.float16}


def load_class(target: str) -> Any:
    """``pkg.module:Name`` or ``path/to/file.py:Name`` (the working directory and ``examples/`` are importable)."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise SystemExit(f"target must be MODULE:CLASS, got {target!r}")
    for extra in (os.getcwd(), os.path.join(os.getcwd(), "examples")):
        if extra not in sys.path:
            sys.path.insert(0, extra)
    if module_name.endswith(".py"):
        module_name = module_name[:-3].replace(os.sep, ".")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def parse_input(spec: str, vocab: int, device: torch.device) -> torch.Tensor:
    shape_s, _, dtype_s = spec.partition(":")
    shape = tuple(int(s) for s in shape_s.lower().split("x"))
    dtype = DTYPES[dtype_s or "float"]
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.randint(0, vocab, shape, dtype=dtype, device=device)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return _first_tensor(next(iter(out.values())))
    return _first_tensor(out[0])


def main(argv: Optional[list[str]] = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m lightning_zero.profiler", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="MODULE:CLASS of an nn.Module or LightningModule")
    ap.add_argument("--kwargs", default="{}", help="constructor keyword arguments as JSON")
    ap.add_argument("--yaml-arg", action="append", default=[], metavar="NAME=FILE", help="a YAML file as one keyword argument")
    ap.add_argument("--input", default=None, help="input shape and dtype, e.g. 2x128:long (default: example_input_array)")
    ap.add_argument("--vocab", type=int, default=256, help="upper bound of random integer inputs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="cast the model to this dtype (e.g. bfloat16)")
    ap.add_argument("--depth", type=int, default=-1, help="module depth of the tree (-1: all)")
    ap.add_argument("--top", type=int, default=1, help="top modules per depth")
    ap.add_argument("--no-backward", action="store_true", help="profile the forward only")
    ap.add_argument("--output", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)

    kwargs: dict[str, Any] = json.loads(args.kwargs)
    for item in args.yaml_arg:
        import yaml

        name, _, path = item.partition("=")
        with open(path) as f:
            kwargs[name] = yaml.safe_load(f)
    device = torch.device(args.device)
    model = load_class(args.target)(**kwargs).to(device)
    if args.dtype:
        model = model.to(DTYPES[args.dtype])
    if args.input:
        x = parse_input(args.input, args.vocab, device)
    else:
        example = getattr(model, "example_input_array", None)
        if not isinstance(example, torch.Tensor):
            raise SystemExit("the model has no example_input_array: pass --input SHAPE[:dtype]")
        x = example.to(device)
    backward = not args.no_backward

    def step() -> None:
        with torch.set_grad_enabled(backward):
            out = _first_tensor(model(x))
            if backward:
                out.float().sum().backward()

    step()  # warm-up: lazy initialisation and autotuning stay out of the profile
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with ModuleProfiler(model, device) as prof:
        step()
    elapsed = time.perf_counter() - t0  # the profiler synchronised on stop
    result = prof.result
    assert result is not None
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    totals = StepTotals(result.params, result.fwd_flops, result.bwd_flops, elapsed, peak)
    title = f"FlopsProfiler: {args.target}, input {tuple(x.shape)} {x.dtype}, {device}" + ("" if backward else ", forward only")
    report = render(result, totals, title, args.depth, args.top)
    print(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(render(result, totals, title, -1, args.top))
    return report


if __name__ == "__main__":
    main()
