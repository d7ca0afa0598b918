"""``python -m lightning_zero.estimate --params 7e9 [--gpus 1] [--nodes 1]``: memory per ZeRO setting.

Prints, for every stage and offload setting, the GPU memory per device, host memory per node and
NVMe space per node that lightning_zero's model states and offload buffers take (offload/estimator.py
says how), whether that fits this machine, and the largest model each setting fits here. From Python:
``lightning_zero.offload.estimate_model(model, gpus_per_node=...)`` reads the sizes off a model.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from lightning_zero.offload.estimator import (
    GIB, SETTINGS, Machine, Setting, Workload, estimate, fits, largest_fitting, per_param_formula,
)
from lightning_zero.offload.pinned import available_host_bytes
from lightning_zero.optim.host_states import PRECISIONS, bytes_per_param


def _count(text: str) -> int:
    """'7e9', '1.3B', '350M', '125k' -> an integer count."""
    t = text.strip().lower().replace("_", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:], 1.0)
    value = float(t[:-1] if t[-1:] in "kmbgt" else t) * mult
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive count is needed, got {text!r}")
    return int(value)


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / GIB:,.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:,.1f} MiB"


def _fmt_count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_zero.estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=_count, required=True, help="parameter count, e.g. 7e9 or 1.3B")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--precision", choices=("bf16-mixed", "16-mixed", "32-true"), default="bf16-mixed")
    p.add_argument("--largest-unit", type=_count, default=None,
                   help="parameters of the largest stage-3 unit (default: params / 24, a 24-block transformer)")
    p.add_argument("--prefetch-units", type=int, default=1)
    p.add_argument("--accumulate", action="store_true", help="gradient accumulation (adds an fp32 host accumulator)")
    p.add_argument("--delayed-update", action="store_true", help="delayed_param_update (double host buffers)")
    p.add_argument("--state-precision", choices=PRECISIONS, default="fp32",
                   help="offload_state_precision of CPU optimizer offload (compact host states)")
    p.add_argument("--device-state-precision", choices=("fp32", "bf16_sr", "bf16_kahan"), default="fp32",
                   help="state_precision of stages 1-3 without offload (16-bit device states, bf16-mixed)")
    p.add_argument("--grad-shard-precision", choices=("fp32", "bf16"), default="fp32",
                   help="grad_shard_precision with 16-bit device states")
    p.add_argument("--nvme-fraction", type=float, default=None,
                   help="share of optimizer states on NVMe for the 'nvme' settings (ZeroConfig.nvme_fraction); "
                        "default: the largest of 1.0, 0.9, ..., 0.1 that fits this machine")
    p.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU memory per device (default: detected)")
    p.add_argument("--host-mem-gib", type=float, default=None, help="host memory per node (default: available now)")
    p.add_argument("--nvme-gib", type=float, default=None, help="NVMe space per node (default: free at --nvme-path)")
    p.add_argument("--nvme-path", default=None, help="where NVMe offload would write (default: /local_nvme, else .)")
    args = p.parse_args(argv)
    if args.gpus < 1 or args.nodes < 1:
        p.error("--gpus and --nodes must be >= 1")
    if args.device_state_precision != "fp32" and args.precision != "bf16-mixed":
        p.error("--device-state-precision needs --precision bf16-mixed")
    if args.grad_shard_precision != "fp32" and args.device_state_precision == "fp32":
        p.error("--grad-shard-precision bf16 needs --device-state-precision bf16_sr or bf16_kahan")
    return args


def detect_machine(args: argparse.Namespace) -> tuple[Machine, str]:
    """This node's capacities (overridable by the --*-gib flags) and a line describing them."""
    words = []
    gpu: Optional[float] = None
    if args.gpu_mem_gib is not None:
        gpu = args.gpu_mem_gib * GIB
        words.append(f"GPU {args.gpu_mem_gib:g} GiB (given)")
    else:
        try:
            import torch

            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                gpu = float(props.total_memory)
                words.append(f"GPU {_fmt_bytes(gpu)} ({props.name})")
        except Exception:  # no torch CUDA: no GPU figure
            pass
        if gpu is None:
            words.append("no GPU detected (GPU limits ignored; pass --gpu-mem-gib)")
    cpu = args.host_mem_gib * GIB if args.host_mem_gib is not None else float(available_host_bytes())
    words.append(f"host {_fmt_bytes(cpu)} {'(given)' if args.host_mem_gib is not None else 'available'}")
    if args.nvme_gib is not None:
        nvme: Optional[float] = args.nvme_gib * GIB
        words.append(f"NVMe {args.nvme_gib:g} GiB (given)")
    else:
        path = Path(args.nvme_path) if args.nvme_path else (Path("/local_nvme") if Path("/local_nvme").is_dir() else Path("."))
        try:
            nvme = float(shutil.disk_usage(path).free)
            words.append(f"NVMe {_fmt_bytes(nvme)} free at {path.resolve()}")
        except OSError:
            nvme = None
            words.append(f"NVMe path {path} not found")
    return Machine(gpu, cpu, nvme), ", ".join(words)


def render(args: argparse.Namespace, machine: Machine, machine_line: str) -> str:
    c = 4 if args.precision == "32-true" else 2
    states16 = {"fp32": 12.0, "bf16_sr": 6.0, "bf16_kahan": 8.0}[args.device_state_precision]  # zero/states16.py

    def make(params: int, fraction: float = 1.0) -> Workload:
        unit = None if args.largest_unit is None else int(args.largest_unit * params / args.params)
        return Workload(params, args.gpus, args.nodes, largest_unit=unit, compute_bytes=c,
                        prefetch_units=args.prefetch_units, accumulate=args.accumulate,
                        delayed_update=args.delayed_update, nvme_fraction=fraction,
                        state_bytes=bytes_per_param(args.state_precision), device_state_bytes=states16,
                        grad_shard_bytes=2.0 if args.grad_shard_precision == "bf16" else 4.0,
                        master_in_params=args.state_precision in ("bf16_sr", "bf16_kahan") and args.precision == "bf16-mixed"
                        and not args.delayed_update)

    def fractions(s: Setting) -> list[float]:
        if s.offload_optimizer != "nvme":
            return [1.0]
        return [args.nvme_fraction] if args.nvme_fraction is not None else [1.0 - i / 10 for i in range(10)]

    grads = 2.0 if args.grad_shard_precision == "bf16" else 4.0
    device = "" if states16 == 12.0 else (f" (device: {args.device_state_precision} states, "
                                          f"{args.grad_shard_precision} gradient shards)")
    lines = [
        f"Memory for {_fmt_count(args.params)} parameters on {args.nodes} node(s) x {args.gpus} GPU(s), {args.precision}, "
        f"Adam{'' if args.state_precision == 'fp32' else f' (CPU offload: {args.state_precision} host states)'}"
        f"{device}. Model states and offload buffers only: activations, the CUDA context and fragmentation come on top.",
        f"This machine: {machine_line}.",
        "",
        "| setting | GPU per device | host per node | NVMe per node | fits here | largest model here (limited by) |",
        "|---|---:|---:|---:|:---:|---:|",
    ]
    for s in SETTINGS:
        fs = fractions(s)
        options = [(estimate(s, make(args.params, f)), f) for f in fs]
        e, frac = next(((e, f) for e, f in options if fits(e, machine)), options[0])
        ok = "yes" if fits(e, machine) else "no"
        if ok == "yes" and machine.gpu_bytes is None:
            ok = "? (no GPU figure)"
        biggest, limit, best_f = max(
            (largest_fitting(s, machine, lambda p, f=f: make(p, f)) + (f,) for f in fs), key=lambda r: r[0]
        )
        largest = "- (needs a GPU figure)" if limit == "-" else f"{_fmt_count(biggest)} ({limit})"
        name = s.name
        if s.offload_optimizer == "nvme":
            name += f" (nvme_fraction {frac:.1f})"
            largest += f" at nvme_fraction {best_f:.1f}" if limit != "-" else ""
        lines.append(
            f"| {name} | {_fmt_bytes(e.gpu_bytes)} | {_fmt_bytes(e.cpu_bytes)} | {_fmt_bytes(e.nvme_bytes)} | {ok} | "
            f"{largest} |"
        )
    per_param = ", ".join(f"{s.name} {per_param_formula(s, c, states16, grads)}" for s in SETTINGS[:4])
    lines += ["", f"Device bytes per parameter at the optimizer step (N = data-parallel ranks; buckets and gathered "
                  f"units on top): {per_param}."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    machine, line = detect_machine(args)
    print(render(args, machine, line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
