"""Weight-only int8 / int4 one-row kernels against bf16 ``F.linear``, per Llama-3-8B Linear shape (issue #31).

The decode step's figure (benchmarks/inference.py) sums ~225 Linears, norms, attention and launch gaps; this
isolates the one part the int8/int4 targets turn on: how many bytes per second each kernel reads at one row.
Per shape and kernel it builds enough distinct layers that one pass reads >= 512 MiB (so H200's 50 MB L2
serves none of it), captures one pass in a CUDA graph (no launch gaps), replays it and reports microseconds
per Linear and GB/s of weight bytes read (codes plus scales; bf16: the weight). Kernels: ``bf16`` (cuBLAS),
``triton`` (triton_wo.py), ``gemv`` (triton_gemv.py), ``reduction`` (inductor_wo.py's expression compiled
with coordinate-descent tuning, what the compiled decode step gets from it).

    python benchmarks/wo_kernels.py [--bits 8,4] [--kernels bf16,triton,gemv,reduction] [--shapes q,kv,up,down]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = {"q": (4096, 4096), "kv": (1024, 4096), "up": (14336, 4096), "down": (4096, 14336), "head": (128256, 4096)}
"""name -> (out_features, in_features) of the Llama-3-8B shape's Linears."""


def _graph_time(fn: Callable[[], None], replays: int = 10) -> float:
    """Seconds per call of ``fn`` (one pass over the layers) replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def _kernel_fn(kernel: str, layers: list, x: torch.Tensor) -> Callable[[], None]:
    from lightning_zero.inference.inductor_wo import reduction_weight_only
    from lightning_zero.inference.triton_gemv import triton_gemv
    from lightning_zero.inference.triton_wo import triton_weight_only

    if kernel == "triton":
        return lambda: [triton_weight_only(x, layer) for layer in layers] and None
    if kernel == "gemv":
        return lambda: [triton_gemv(x, layer) for layer in layers] and None
    if kernel == "reduction":
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        compiled = torch.compile(reduction_weight_only, dynamic=False)
        return lambda: [compiled(x, layer) for layer in layers] and None
    raise ValueError(kernel)


def _kernel_out(kernel: str, layer, x: torch.Tensor) -> torch.Tensor:
    """One layer's output through ``kernel`` (the error check against dequantize-then-matmul)."""
    from lightning_zero.inference.triton_gemv import triton_gemv
    from lightning_zero.inference.triton_wo import triton_weight_only

    return (triton_weight_only if kernel == "triton" else triton_gemv)(x, layer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", default="8,4")
    p.add_argument("--kernels", default="bf16,triton,gemv,reduction")
    p.add_argument("--shapes", default="q,kv,up,down")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--read-mib", type=int, default=512, help="bytes one pass reads (distinct layers), MiB")
    args = p.parse_args()
    from lightning_zero.inference.quant import QuantLinear

    torch.manual_seed(0)
    dev = torch.device("cuda")
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__} · {now}")
    rows = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        bf16_bytes = n * k * 2
        copies = max(2, min(256, args.read_mib * 2**20 // bf16_bytes + 1))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        if "bf16" in args.kernels.split(","):
            secs = _graph_time(lambda: [F.linear(x, w) for w in weights] and None) / copies
            rows.append({"shape": shape, "n": n, "k": k, "bits": 16, "kernel": "bf16", "us": secs * 1e6,
                         "gbps": bf16_bytes / secs / 1e9})
            print(json.dumps(rows[-1]), flush=True)
        for bits in (int(b) for b in args.bits.split(",")):
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            q_bytes = n * k * bits // 8 + n * k // args.group_size * 4
            q_copies = max(2, min(512, args.read_mib * 2**20 // q_bytes + 1))
            layers = []
            for i in range(q_copies):
                lin.weight.data.copy_(weights[i % copies])
                layers.append(QuantLinear.from_linear(lin, bits, args.group_size).eval())
            with torch.no_grad():
                ref = F.linear(x, layers[0].dequantized_weight(torch.bfloat16))
                for kernel in (kk for kk in args.kernels.split(",") if kk != "bf16"):
                    fn = _kernel_fn(kernel, layers, x)
                    try:
                        secs = _graph_time(fn) / q_copies
                    except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, the rest still run
                        print(json.dumps({"shape": shape, "bits": bits, "kernel": kernel, "error": repr(e)[:300]}))
                        continue
                    err = None
                    if kernel in ("triton", "gemv"):
                        out = _kernel_out(kernel, layers[0], x)
                        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                    rows.append({"shape": shape, "n": n, "k": k, "bits": bits, "kernel": kernel, "us": secs * 1e6,
                                 "gbps": q_bytes / secs / 1e9, "rel_err": err})
                    print(json.dumps(rows[-1]), flush=True)
            del layers
        del weights
        torch.cuda.empty_cache()
    try:
        from lightning_zero.inference import triton_gemv, triton_wo

        for name, kern in (("triton", triton_wo._weight_only_kernel), ("gemv", triton_gemv._gemv_kernel)):
            cache = getattr(kern, "cache", {})
            for key, cfg in cache.items():
                print(f"# best {name} {key}: {cfg}")
    except Exception as e:  # noqa: BLE001
        print(f"# best configs unavailable: {e!r}")
    print("\n| shape | N x K | kernel | bits | us / Linear | GB/s | x bf16 time |")
    print("|---|---|---|---|---|---|---|")
    base = {r["shape"]: r["us"] for r in rows if r["kernel"] == "bf16"}
    for r in rows:
        ratio = base.get(r["shape"], float("nan")) / r["us"]
        print(f"| {r['shape']} | {r['n']} x {r['k']} | {r['kernel']} | {r['bits']} | {r['us']:.1f} | "
              f"{r['gbps']:.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
