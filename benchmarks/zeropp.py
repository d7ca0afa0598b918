"""ZeRO++ (qwZ, qgZ, hpZ; issue #33) against plain zero3: tokens/s, bytes per step and loss, side by side.

Run under torchrun from the repository root with it on ``PYTHONPATH``, one process per device; prints a
markdown table on rank 0:

    torchrun --nproc-per-node 4 benchmarks/zeropp.py --device cuda --model xl --hpz 2          # NVLink
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \\
        torchrun --nproc-per-node 4 benchmarks/zeropp.py --device cuda --model xl --hpz 2      # a slow link
    torchrun --nproc-per-node 4 benchmarks/zeropp.py --device cpu --model tiny --steps 6 --hpz 2 --persist 0  # gloo

Each variant trains the example GPT (examples/gpt.py) on the same random token batches from the same
weights under ``ZeroFabricStrategy(stage=3, ...)`` (bf16-mixed on CUDA, fp32 on CPU), one after the other in
this process group: ``zero3``, ``qwZ`` (int8 weights), ``qgZ`` (int4 gradients), ``qgZ-sr`` (the same, rounded
stochastically: ``gradient_rounding="stochastic"``), ``qwZ+qgZ``, and with
``--hpz`` > 1 also ``hpZ`` and ``qwZ+qgZ+hpZ``. Reported: the median step time after the first ``--skip``
steps, tokens/s over all ranks and its ratio to zero3's, the bytes one rank sent per step as the engine
counted them (all of them, and those that leave an hpZ group: comm/traffic.py), and the last step's loss
(for trends only: random tokens; the loss claim of issue #33 is measured on the corpus with
``examples/train.py strategy=zero3 strategy.quantized_weights=int8 ...``).

``NCCL_NVLS_ENABLE=0`` is set unless given (NVLink SHARP multicast is off on the lent machines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

warnings.filterwarnings("ignore")

from lightning.fabric import Fabric  # noqa: E402

import lightning_zero  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

MODELS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=64),
    "medium": GPTConfig(vocab_size=256, n_layer=8, n_head=8, d_model=512, seq_len=128),
    "large": GPTConfig(vocab_size=50304, n_layer=12, n_head=16, d_model=1024, seq_len=512),
    "xl": GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024),
}
NODE_LOCAL = ("param_gather_node", "grad_reduce_node")
"""Traffic labels that stay inside an hpZ group (zero/zeropp.py)."""


def variants(hpz: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "zero3": {}, "qwZ": {"quantized_weights": "int8"}, "qgZ": {"quantized_gradients": "int4"},
        "qgZ-sr": {"quantized_gradients": "int4", "gradient_rounding": "stochastic"},
        "qwZ+qgZ": {"quantized_weights": "int8", "quantized_gradients": "int4"},
    }
    if hpz > 1:
        out["hpZ"] = {"hpz_partition_size": hpz}
        out["qwZ+qgZ+hpZ"] = {"quantized_weights": "int8", "quantized_gradients": "int4", "hpz_partition_size": hpz}
    return out


def run(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, float]:
    cuda = args.device == "cuda"
    strategy = lightning_zero.ZeroFabricStrategy(stage=3, **options)
    fabric = Fabric(accelerator="gpu" if cuda else "cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                    num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
                    strategy=strategy, precision="bf16-mixed" if cuda else "32-true")
    fabric.launch()
    cfg = MODELS[args.model]
    fabric.seed_everything(0)
    with fabric.init_module():
        net = GPT(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda)
    net, opt = fabric.setup(net, opt)
    engine = fabric.strategy.engines[0]
    gen = torch.Generator().manual_seed(1 + fabric.global_rank)
    times, losses = [], []
    before = engine.bytes_sent()
    for step in range(args.steps):
        if step == args.skip:
            before = engine.bytes_sent()
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen).to(fabric.device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = net(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    after = engine.bytes_sent()
    measured = max(1, args.steps - args.skip)
    sent = {k: (v - before.get(k, 0)) / measured for k, v in after.items()}
    step_s = statistics.median(times[args.skip:] or times)
    tokens = args.batch * cfg.seq_len * fabric.world_size
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "bytes": sum(sent.values()),
            "bytes_leaving": sum(v for k, v in sent.items() if k not in NODE_LOCAL), "loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--hpz", type=int, default=1, help="hpz_partition_size for the hpZ variants (1: none)")
    parser.add_argument("--block", type=int, default=2048, help="quant_block_size")
    parser.add_argument("--variants", default="", help="comma-separated variants to run (zero3 first; default: all)")
    parser.add_argument("--persist", type=int, default=None,
                        help="param_persistence_threshold (default: the library's; 0 for the tiny model, whose blocks "
                             "would all stay gathered)")
    args = parser.parse_args()
    rows = []
    chosen = variants(args.hpz)
    if args.variants:
        unknown = set(args.variants.split(",")) - set(chosen)
        if unknown or not args.variants.startswith("zero3"):
            parser.error(f"--variants: zero3 first, then any of {list(chosen)} (unknown: {sorted(unknown)})")
        chosen = {k: chosen[k] for k in args.variants.split(",")}
    for name, options in chosen.items():
        if args.persist is not None:
            options = dict(options, param_persistence_threshold=args.persist)
        if any(k.startswith("quantized") for k in options):
            options = dict(options, quant_block_size=args.block)
        rows.append((name, run(args, options)))
    if int(os.environ.get("RANK", "0")) != 0:
        return
    base = rows[0][1]
    world = int(os.environ["WORLD_SIZE"])
    print(f"\nZeRO++ vs zero3: GPT {args.model}, {world} ranks, {args.device}, batch {args.batch}/rank, "
          f"median of steps {args.skip}..{args.steps - 1}, NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '-')}\n")
    print("| variant | step (s) | tokens/s | vs zero3 | MB sent/step | MB leaving hpZ group | x zero3 bytes | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        print(f"| {name} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{r['bytes'] / 2**20:.1f} | {r['bytes_leaving'] / 2**20:.1f} | {r['bytes_leaving'] / base['bytes']:.2f} | "
              f"{r['loss']:.4f} |")


if __name__ == "__main__":
    main()
