"""Does ZeRO++ track zero3 step by step at the loss-check size? (issue #33; a diagnostic, run under torchrun)

Why: on 4 H200s, F's 303M run (run_pending.sh F/FG/Q) trained to a 2-11% *lower* validation loss with qwZ + qgZ +
hpZ than with zero3, while qwZ alone and qgZ alone (2 GPUs) stayed within 1% and every CPU run went the other
way. The parity suite (tests/quant/test_zeropp.py) holds each switch to a per-step bound on tiny models with
tiny buckets; this runs the same comparison at F's size (24 x 1024, seq 1024, 2 rows per rank, F's 50 MB
buckets, bf16-mixed, AdamW at lr 1e-3 and weight decay 0.1, clipping at 1.0: examples/train.py's recipe), so a
defect that only shows with large buckets or many units shows here within a few steps, beside the run-to-run
spread of zero3 itself (``zero3_again``; CUDA's reductions are not deterministic).

    PYTHONPATH=. python3 -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/zeropp_track.py --steps 8

Every config trains from the same initial weights on the same batches. Rank 0 keeps zero3's full fp32 weights
after each step (host memory) and prints, per config and step: the loss relative to zero3's, the weights'
relative distance ``||W - W_zero3|| / ||W_zero3||`` and the gradient norm before clipping (the strategy's).
The suite's bound (tests/quant/test_zeropp.py [Note: the bound the quantized runs are held to]) is printed beside.
"""

from __future__ import annotations

import argparse
import os

import torch

CONFIGS = {
    "zero3": {}, "zero3_again": {}, "hpz": {"hpz_partition_size": 2},
    "qw": {"quantized_weights": "int8"}, "qg": {"quantized_gradients": "int4"},
    "qg_hpz": {"quantized_gradients": "int4", "hpz_partition_size": 2},
    "qg_b256": {"quantized_gradients": "int4", "quant_block_size": 256},  # does a smaller block narrow qgZ's distance?
    "qg8": {"quantized_gradients": "int8"},
    "qg_sr": {"quantized_gradients": "int4", "gradient_rounding": "stochastic"},  # int4 without rounding's bias?
    "all_sr": {"quantized_weights": "int8", "quantized_gradients": "int4", "hpz_partition_size": 2,
               "gradient_rounding": "stochastic"},
    "all": {"quantized_weights": "int8", "quantized_gradients": "int4", "hpz_partition_size": 2},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, zero3 first: {list(CONFIGS)}")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2, help="rows per rank per step")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size (default: the strategy's)")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def full_weights(fabric: object) -> dict[str, torch.Tensor]:
    return {k: v.float().cpu() for k, v in fabric.strategy.full_state_dict().items()}  # type: ignore[attr-defined]


def distance(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``||W - W_ref|| / ||W_ref||`` over all parameters as one vector, summed tensor by tensor (no copy of all)."""
    num = sum(float((got[k] - v).double().pow(2).sum()) for k, v in ref.items())
    den = sum(float(v.double().pow(2).sum()) for v in ref.values())
    return (num / den) ** 0.5


def run(args: argparse.Namespace, name: str, data: torch.Tensor, init: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Train ``args.steps`` steps of config ``name``; returns (global loss, grad norm) per step and, on rank 0,
    the full weights after each step."""
    from lightning.fabric import Fabric

    from examples.gpt import GPT, GPTConfig

    import lightning_zero

    world = int(os.environ["WORLD_SIZE"])
    extra = {} if args.bucket_mb is None else {"bucket_size_mb": args.bucket_mb}
    strategy = lightning_zero.ZeroFabricStrategy(stage=3, **extra, **CONFIGS[name])
    fabric = Fabric(accelerator="gpu" if args.device == "cuda" else "cpu", devices=world, strategy=strategy,
                    precision=args.precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        net = GPT(GPTConfig(vocab_size=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                            seq_len=args.seq))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    net, opt = fabric.setup(net, opt)
    with fabric.strategy.gathered_params(net, writeback=True):  # every config from the same weights
        with torch.no_grad():
            for n, p in net.module.named_parameters():
                p.copy_(init[n].to(p.device, p.dtype))
    out, weights = [], []
    for step in range(args.steps):
        x = data[step, fabric.global_rank :: world].to(fabric.device)
        logits = net(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), x[:, 1:].reshape(-1))
        fabric.backward(loss)
        norm = fabric.clip_gradients(net, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        out.append((float(fabric.all_reduce(loss.detach(), reduce_op="mean")), float(norm)))
        w = full_weights(fabric)
        if fabric.global_rank == 0:
            weights.append(w)
    return out, weights


def main() -> None:
    args = parse_args()
    from examples.gpt import GPT, GPTConfig

    names = args.configs.split(",")
    if names[0] != "zero3":
        raise SystemExit("--configs must start with zero3 (the reference)")
    torch.manual_seed(0)
    init = GPT(GPTConfig(vocab_size=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                         seq_len=args.seq)).state_dict()
    world = int(os.environ["WORLD_SIZE"])
    data = torch.randint(0, 256, (args.steps, world * args.rows, args.seq + 1),
                         generator=torch.Generator().manual_seed(1))
    rank0 = int(os.environ.get("RANK", 0)) == 0
    ref_losses: list = []
    ref_weights: list = []
    for name in names:
        stats, weights = run(args, name, data, init)
        if name == "zero3":
            ref_losses, ref_weights = stats, weights
        if not rank0:
            continue
        print(f"\n## {name}", flush=True)
        print("| step | loss | loss / zero3 - 1 | grad norm | grad norm / zero3 | weights rel. dist. | suite bound |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for t, ((loss, norm), (rl, rn)) in enumerate(zip(stats, ref_losses), start=1):
            rel = distance(weights[t - 1], ref_weights[t - 1])
            print(f"| {t} | {loss:.4f} | {loss / rl - 1:+.2e} | {norm:.4f} | {norm / rn:.3f} | {rel:.2e} | "
                  f"{0.01 + 0.005 * t:.3f} |", flush=True)


if __name__ == "__main__":
    main()
