"""Batch-1 decode speed of ``lightning_zero.inference.generate`` against the weight-bandwidth roofline and HF's
``generate``, every figure measured in the same run (issue #31's Performance section).

    python3 benchmarks/inference.py                                   # one GPU: Llama-3-8B shape, bf16
    python3 benchmarks/inference.py --peer-compile                    # + HF static cache and torch.compile
    python3 benchmarks/inference.py --device cpu --model llama_tiny --new-tokens 8 --dtype float32 \
        --backend eager                                               # CPU smoke, seconds
    python3 benchmarks/inference.py --offload --batch 16 --new-tokens 8      # ZeRO-Inference from host memory
    torchrun --nproc-per-node 2 benchmarks/inference.py --tp 2           # batch-1 latency, tp 2 against tp 1

``--offload``: the model built on the meta device in ``configure_model`` and materialised by the evaluation
engine unit by unit into pinned host memory (``zero3_offload``, one device, ``bf16-mixed``), decoding
``--batch`` prompts in ``predict_step``: every forward streams every unit's weights to the device once, so
its roofline is ``batch x`` the host-to-device bandwidth (measured, pinned) / weight bytes (target: >= 0.8x).
``--peer-accelerate`` adds the issue's peer in the same run: the same model in host memory dispatched by HF
Accelerate (``infer_auto_device_map`` + ``dispatch_model``, what ``from_pretrained(device_map="auto")`` does)
with ``--peer-gpu-gib`` GiB of GPU memory allowed, so the other layers stay on the host and are copied to the
GPU at each forward, decoding with HF's ``generate`` (target: ours >= 2x).

``--tp 2`` (under torchrun, one process per GPU): every rank first decodes with the whole model (tp 1, each
rank on its own GPU), then applies ``tp_plan_llama`` over the 2 ranks (lightning_zero.parallel) and decodes
again, eager and compiled; the table gives ms per token and tp 2's latency over tp 1's (target: <= 0.6x).

Rows (random weights, ``benchmarks/presets.py`` shapes, nothing downloaded; prompt ``--prompt`` tokens):
``roofline`` (weight bytes / the device's read bandwidth, measured by a device-to-device copy),
``ours_<dtype>`` (``generate`` with HF's dynamic cache, eager), ``ours_compiled`` (``generate(compile=True)``:
static cache, the step compiled, CUDA graphs on CUDA), ``hf_dynamic`` (HF ``generate``, greedy),
``ours_compiled_no_cdt`` (the same with ``DecodeConfig(coordinate_descent=False)``: without inductor's
coordinate-descent tuning, gpt-fast's batch-1 setting and our default), ``hf_static_compiled`` (``--peer-compile``: HF's recipe for transformers
5: one ``StaticCache`` made up front and passed as ``past_key_values`` to every call, ``reset()`` between
calls, so its tensors keep their addresses; ``generate`` compiles the forward itself for a static cache
(``reduce-overhead``, CUDA graphs). A fresh cache per call, what ``cache_implementation="static"`` does,
re-records the graphs at every call: the 9.9 tokens/s of 2026-11-28 03:29 and 10:05 was that, not HF's speed),
``ours_int8`` / ``ours_int4`` (``quantize_linears`` at group 128, the head kept, decoded with
``compile=True``, one row per kernel of ``--quant-kernel``: ``gemv`` (triton_gemv.py, the seam's first),
``triton`` (triton_wo.py), ``reduction`` (inductor_wo.py); ``--eager-quant`` decodes
uncompiled).
Decode tokens/s = ``(n - 1) / (t(n) - t(1))``: the prompt's forward cancels out. Targets: ours_compiled >=
0.7x roofline and >= 1.5x hf_static_compiled; int8 >= 1.6x and int4 >= 2.5x ours (the ``x ours`` column is
against the faster of ours_compiled and ours_compiled_no_cdt).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from typing import Callable

import torch

from benchmarks.presets import llama_preset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama_8b", help="Llama preset (benchmarks/presets.py)")
    p.add_argument("--layers", type=int, default=None, help="override the depth")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="median of this many timings")
    p.add_argument("--peer-compile", action="store_true", help="also HF generate with a static cache, compiled")
    p.add_argument("--no-quant", action="store_true", help="skip the int8/int4 rows")
    p.add_argument("--eager-quant", action="store_true", help="decode the int8/int4 rows without compile")
    p.add_argument("--quant-kernel", default="gemv",
                   help="comma-separated kernels for the int8/int4 rows, each first at the seam in turn: gemv "
                        "(triton_gemv.py, the default), triton (triton_wo.py), reduction (inductor_wo.py)")
    p.add_argument("--quant-skip", default="lm_head",
                   help="comma-separated fnmatch patterns of Linears kept in bf16 for the int8/int4 rows ('' "
                        "quantizes the head too, as gpt-fast's int8/int4 recipes do)")
    p.add_argument("--no-cdt", action="store_true", help="skip ours_compiled_no_cdt")
    p.add_argument("--no-compile", action="store_true", help="skip ours_compiled (and compile nothing of ours)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of ours (eager: a cheap CPU smoke)")
    p.add_argument("--offload", action="store_true", help="ZeRO-Inference from host memory instead (see above)")
    p.add_argument("--batch", type=int, default=1, help="prompts per forward (--offload)")
    p.add_argument("--peer-accelerate", action="store_true", help="--offload: also HF Accelerate's CPU offload")
    p.add_argument("--peer-gpu-gib", type=float, default=4.0, help="GPU memory Accelerate may fill (the rest offloads)")
    p.add_argument("--peer-new-tokens", type=int, default=None,
                   help="--peer-accelerate: tokens per timed generate of the peer (default --new-tokens; 2 times one "
                        "decode step, which at the 70B shape takes Accelerate tens of seconds)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (run under torchrun, see above)")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The preset's LlamaForCausalLM, random N(0, 0.02) weights made on the device directly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, dims = llama_preset(args.model, args.layers)
    dims.pop("seq_len")
    cfg = LlamaConfig(**dims, max_position_embeddings=args.prompt + args.new_tokens + 8)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device).eval()  # allocated once, in the compute dtype
    gen = torch.Generator(device=device).manual_seed(0)
    # on the host, torch draws normal_ on one thread (minutes for the 70B shape's 35B weights of the host
    # peer): one 4M-element draw is tiled over every weight instead, a parallel copy (timing needs no more)
    tile = torch.empty(1 << 22, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen) \
        if device.type == "cpu" else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif tile is None:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                flat = p.view(-1)
                for i in range(0, flat.numel(), tile.numel()):
                    flat[i : i + tile.numel()].copy_(tile[: flat.numel() - i])
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)  # to_empty left its buffers unset
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second the device reads, from a copy (which reads and writes every byte)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def decode_rate(run: Callable[[int], object], n: int, repeats: int, device: torch.device) -> float:
    """Decode tokens/s of ``run(new_tokens)``: (n - 1) / (t(n) - t(1)), medians over ``repeats``."""
    def timed(k: int) -> float:
        out = []
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            run(k)
            sync(device)
            out.append(time.perf_counter() - t)
        return sorted(out)[len(out) // 2]

    run(n)  # warm-up: compiles and records the CUDA graphs of the compiled rows, at both lengths timed
    run(1)  # (a static cache sized by the length is another shape: its first call must not be timed)
    span = timed(n) - timed(1)
    return (n - 1) / span if span > 0 else float("nan")  # nan: too few tokens to time (noise won)


class _Rows(list):
    """The rows, each printed as it is measured (a run cut short by a time limit still reports what it did)."""

    def append(self, row: tuple[str, float]) -> None:
        super().append(row)
        print(f"row {row[0]}: {row[1]:.1f} tokens/s", flush=True)


def guarded_rate(name: str, run: Callable[[int], object], n: int, repeats: int, device: torch.device) -> float:
    """``decode_rate``, or nan with the error printed: one failing row (a compile on an untested stack) leaves
    the others' figures standing."""
    try:
        return decode_rate(run, n, repeats, device)
    except Exception as err:  # noqa: BLE001 - reported, the table goes on
        print(f"{name} failed: {type(err).__name__}: {err}"[:600], flush=True)
        return float("nan")


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second from pinned host memory to ``device`` (a host copy on a CPU-only machine)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times)[len(times) // 2]


def offload_main(args: argparse.Namespace, device: torch.device) -> None:
    """Decode under ``zero3_offload`` on one device (see the module docstring)."""
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_zero import ZeroStrategy
    from lightning_zero.inference import generate

    _, dims = llama_preset(args.model, args.layers)
    dims.pop("seq_len")
    cfg = LlamaConfig(**dims, max_position_embeddings=args.prompt + args.new_tokens + 8)

    class Decode(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.rates: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:  # on the meta device: materialised unit by unit into host memory
                self.model = LlamaForCausalLM(cfg)

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            assert self.model is not None
            self.rates.append(decode_rate(lambda k: generate(self.model, batch[0], k), args.new_tokens, 1,
                                          self.device))

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, cfg.vocab_size, (args.batch * args.repeats, args.prompt))),
        batch_size=args.batch)
    module = Decode()
    precision = "bf16-mixed" if args.dtype == "bfloat16" else "32-true"
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision=precision,
                         strategy=ZeroStrategy(stage=3, offload_params="cpu", offload_optimizer="cpu"),
                         logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.predict(module, data, return_predictions=False)
    assert module.model is not None
    weight_bytes = sum(p.numel() for p in module.model.parameters()) * torch.empty((), dtype=getattr(
        torch, args.dtype)).element_size()
    roofline = args.batch * h2d_bandwidth(device) / weight_bytes
    rate = args.batch * sorted(module.rates)[len(module.rates) // 2]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"## ZeRO-Inference decode from host memory, batch {args.batch}, {args.model} ({weight_bytes / 2**30:.2f} "
          f"GiB of {args.dtype} weights), {name}, {datetime.date.today()}\n")
    rows = _Rows()  # each printed now: a peer cut short by a time limit leaves ours standing
    rows.append(("pcie_roofline", roofline))
    rows.append(("zero3_offload", rate))
    if args.peer_accelerate:
        del module, trainer  # host memory for the peer's copy
        rows.append(("accelerate_device_map_auto", accelerate_offload_rate(args, device, data)))
    print("| run | tokens/s | x roofline | x accelerate |\n| --- | --- | --- | --- |")
    peer = dict(rows).get("accelerate_device_map_auto")
    for run_name, value in rows:
        versus = f"{value / peer:.2f}" if peer else "-"
        print(f"| {run_name} | {value:.2f} | {value / roofline:.2f} | {versus} |")


def accelerate_offload_rate(args: argparse.Namespace, device: torch.device,
                            data: torch.utils.data.DataLoader) -> float:
    """Decode tokens/s (x batch) of HF ``generate`` on the model dispatched by Accelerate with
    ``--peer-gpu-gib`` of GPU memory: the layers that do not fit stay in host memory and are copied to the GPU
    at every forward (see the module docstring)."""
    import gc

    from accelerate import dispatch_model, infer_auto_device_map

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dtype = getattr(torch, args.dtype)
    model = build(args, torch.device("cpu"), dtype)
    gpu = (device.index or 0) if device.type == "cuda" else "cpu"
    budget = {gpu: f"{args.peer_gpu_gib}GiB"} if device.type == "cuda" else {}
    device_map = infer_auto_device_map(model, max_memory={**budget, "cpu": "100000GiB"}, dtype=dtype,
                                       no_split_module_classes=[type(model.model.layers[0]).__name__])
    model = dispatch_model(model, device_map=device_map, main_device=gpu)
    offloaded = sum(1 for where in device_map.values() if where == "cpu")
    print(f"accelerate: {offloaded} of {len(device_map)} device_map entries offloaded to the host", flush=True)
    rates = []
    for (batch,) in data:
        batch = batch.to(device)
        mask = torch.ones_like(batch)
        run = lambda k: model.generate(batch, attention_mask=mask, max_new_tokens=k, do_sample=False)  # noqa: E731
        rates.append(decode_rate(run, args.peer_new_tokens or args.new_tokens, 1, device))
    return args.batch * sorted(rates)[len(rates) // 2]


def tp_main(args: argparse.Namespace) -> None:
    """Batch-1 decode latency at tp 1 and tp ``args.tp`` in one torchrun job (see the module docstring)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.inference import DecodeConfig, generate
    from lightning_zero.parallel import parallelize, tp_plan_llama

    rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} runs under torchrun --nproc-per-node {args.tp} (WORLD_SIZE is {world})")
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    dtype = getattr(torch, args.dtype)
    model = build(args, device, dtype)  # the same seed on every rank: the same weights
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    decode = DecodeConfig(backend=args.backend)
    runs = {"eager": lambda k: generate(model, prompt, k), "compiled": lambda k: generate(model, prompt, k,
                                                                                           compile=decode)}
    rows: list[tuple[str, float]] = _Rows() if rank == 0 else []  # rank 0 prints each row as it is measured
    for degree in (1, args.tp):
        if degree > 1:
            model.__dict__.pop("_lz_compiled_decoder", None)  # its cache has every head: tp 2's has half
            parallelize(model, mesh["tp"], tp_plan_llama(model, mesh["tp"]))
        for name, run in runs.items():
            if name == "compiled" and args.no_compile:
                continue
            rows.append((f"tp{degree}_{name}", guarded_rate(f"rank {rank}: tp{degree}_{name}", run, args.new_tokens,
                                                            args.repeats, device)))
    if rank == 0:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        print(f"## Decode latency, batch 1, {args.model}, {args.dtype}, tp 1 vs tp {args.tp}, {gpu}, "
              f"{datetime.date.today()}\n")
        base = dict(rows)
        print("| run | tokens/s | ms/token | latency x tp1 |\n| --- | --- | --- | --- |")
        for name, rate in rows:
            tp1 = base[f"tp1_{name.split('_', 1)[1]}"]
            print(f"| {name} | {rate:.1f} | {1e3 / rate:.2f} | {tp1 / rate:.2f} |")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    unknown = set(args.quant_kernel.split(",")) - {"triton", "gemv", "reduction"}
    if unknown:
        raise SystemExit(f"--quant-kernel: unknown {sorted(unknown)}; take triton, gemv or reduction")
    if args.tp > 1:
        tp_main(args)
        return
    if args.offload:
        offload_main(args, torch.device(args.device))
        return
    from lightning_zero.inference import DecodeConfig, generate, quantize_linears

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(args, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=device)
    mask = torch.ones_like(prompt)
    rows = _Rows()
    rows.append(("roofline", read_bandwidth(device) / weight_bytes))
    ours = lambda m: (lambda k: generate(m, prompt, k))  # noqa: E731
    rows.append((f"ours_{args.dtype}", decode_rate(ours(model), args.new_tokens, args.repeats, device)))
    if not args.no_compile:
        decode = DecodeConfig(backend=args.backend)
        compiled = lambda m: (lambda k: generate(m, prompt, k, compile=decode))  # noqa: E731
        rows.append(("ours_compiled", guarded_rate("ours_compiled", compiled(model), args.new_tokens, args.repeats,
                                                   device)))
        untuned = DecodeConfig(backend=args.backend, coordinate_descent=False)
        if not args.no_cdt and args.backend == "inductor":
            rows.append(("ours_compiled_no_cdt", guarded_rate(
                "ours_compiled_no_cdt", lambda k: generate(model, prompt, k, compile=untuned), args.new_tokens,
                args.repeats, device)))
    hf = lambda k: model.generate(prompt, attention_mask=mask, max_new_tokens=k, do_sample=False)  # noqa: E731
    rows.append(("hf_dynamic", decode_rate(hf, args.new_tokens, args.repeats, device)))
    if args.peer_compile:
        from lightning_zero.inference.static_cache import hf_static_cache

        cache = hf_static_cache(model, 1, args.prompt + args.new_tokens, device, dtype)

        def hf_static(k: int) -> object:
            cache.reset()  # the same tensors every call: generate's compiled forward and its graphs are reused
            return model.generate(prompt, attention_mask=mask, max_new_tokens=k, do_sample=False,
                                  past_key_values=cache)

        rows.append(("hf_static_compiled", guarded_rate("hf_static_compiled", hf_static, args.new_tokens,
                                                        args.repeats, device)))
        del cache
    if not args.no_quant:
        from lightning_zero.inference import quant
        from lightning_zero.inference.triton_gemv import triton_gemv

        first = {"triton": quant.triton_weight_only, "gemv": triton_gemv, "reduction": quant.inductor_weight_only}
        default = list(quant._KERNELS)
        kernels = args.quant_kernel.split(",")
        for kernel in kernels:
            # this process only: the kernel asked for first at the seam; the others stay behind it for what it declines
            quant._KERNELS[:] = [first[kernel]] + [k for k in default if k is not first[kernel]]
            for bits in (8, 4):
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                model = build(args, device, dtype)
                quantize_linears(model, bits=bits, group_size=128, skip=[p for p in args.quant_skip.split(",") if p])
                run = ours(model) if args.eager_quant or args.no_compile else compiled(model)
                name = f"ours_int{bits}" + (f"_{kernel}" if len(kernels) > 1 else "")
                rows.append((name, guarded_rate(name, run, args.new_tokens, args.repeats, device)))
                torch._dynamo.reset()  # the next kernel's step is traced afresh
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"## Decode, batch 1, {args.model} ({weight_bytes / 2**30:.2f} GiB of {args.dtype} weights), "
          f"{name}, {datetime.date.today()}\n")
    base = dict(rows)
    ours_best = max((base.get(name, float("nan")) for name in ("ours_compiled", "ours_compiled_no_cdt")),
                    key=lambda r: -1.0 if r != r else r)
    if ours_best != ours_best:  # not run, or failed: against the eager row
        ours_best = base[f"ours_{args.dtype}"]
    print("| run | tokens/s | x roofline | x ours |\n| --- | --- | --- | --- |")
    for run_name, rate in rows:
        print(f"| {run_name} | {rate:.1f} | {rate / base['roofline']:.2f} | {rate / ours_best:.2f} |")


if __name__ == "__main__":
    main()
