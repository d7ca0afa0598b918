"""Scenario ``quant.zeropp`` (tests/quant/scenarios.py): ZeRO++ (qwZ, qgZ, hpZ) against plain zero3 on the
example GPT and an HF Llama from a tiny config, trained by a Fabric loop in fp32 on gloo.

``runs``: ``{NAME: "MODEL[:key=value,...]"}`` with MODEL ``gpt`` (activation checkpointing on, so a unit's
forward is recomputed inside backward) or ``llama``; keys ``qw`` (quantized_weights), ``qg``
(quantized_gradients), ``round`` (gradient_rounding), ``hpz`` (hpz_partition_size), ``block`` (quant_block_size, default 256: the tiny units'
chunks are smaller than DeepSpeed's 2048), ``steps`` (default 4), ``precision`` (default ``32-true``), ``accum``
(micro-batches per step, default 1: each rank's rows split in that many backwards), ``twostep`` (1: qgZ's sum
returned, then copied or added into the gradient shard by the engine, the path before comm/quantized.py
[Note: qgZ into the gradient shard], as the reference of the direct write). Every run trains from the same weights on
the same batches (each rank its rows of a global batch), with AdamW; on CPU and gloo, or one GPU per rank
over NCCL with ``LZ_TEST_ACCELERATOR=gpu`` (tests/helpers/launch.py). Rank 0 writes ``OUT/NAME.pt``: the
global loss and the full fp32 weights after each step, the bytes the engine counted per step by label, and
the largest hpZ secondary storage seen between forward and backward beside the non-root units' size,
whether ``gathered_params`` shows the masters' exact values (rounded to the compute dtype), and how many
bucket chunks of the gradient shard were written first (copied) and accumulated (added) over the run.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402
from tests.helpers.parity_runs import parse  # noqa: E402
from tests.helpers.worker_io import save_atomic  # noqa: E402

VOCAB, SEQ, GLOBAL = 64, 16, 8


def build(model: str) -> torch.nn.Module:
    if model == "gpt":
        from gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=3, n_head=2, d_model=32, seq_len=SEQ, activation_checkpointing=True))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


def loss_of(model: str, net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if model == "gpt":
        logits = net(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    return net(input_ids=x, labels=x).loss


def use_two_steps(engine: Any) -> None:
    """qgZ as it was before the direct write: the reduction returns its fp32 mean, which the engine then
    copies or adds into the gradient shard (``add_to_grad_shard``)."""
    from lightning_zero.zero.engine import _Pending

    direct = engine._reduce_scatter_into_shard

    def reduce(gi: int, bi: int, bucket: torch.Tensor, after: Any = None) -> Any:
        comm, fg = engine.comms[gi], engine.groups[gi]
        if not engine.zpp.quantizes_gradients or comm.size == 1:
            return direct(gi, bi, bucket, after)
        work = engine.zpp.start_reduce_scatter(bucket, comm.group, engine.dp_size)

        def finalize() -> None:
            fg.add_to_grad_shard(bi, work.result)
            if after is not None:
                after()

        return _Pending(work, finalize)

    engine._reduce_scatter_into_shard = reduce


def count_shard_writes(engine: Any, counts: dict[str, int]) -> None:
    """Count the gradient shard's chunk writes by kind, whichever path makes them."""
    for fg in engine.groups:
        def counted(bi: int, _orig: Any = fg.grad_chunk_to_write) -> tuple[torch.Tensor, bool]:
            chunk, accumulate = _orig(bi)
            counts["added" if accumulate else "copied"] += 1
            return chunk, accumulate

        fg.grad_chunk_to_write = counted


def run(name: str, spec: str) -> dict[str, Any]:
    model, opts = parse(spec)
    world = int(os.environ["WORLD_SIZE"])
    strategy = lightning_zero.ZeroFabricStrategy(
        stage=3, param_persistence_threshold=0, bucket_size_mb=0.002, quantized_weights=opts.get("qw", False),
        quantized_gradients=opts.get("qg", False), hpz_partition_size=int(opts.get("hpz", 1)),
        quant_block_size=int(opts.get("block", 256)), gradient_rounding=opts.get("round", "nearest"))
    fabric = Fabric(accelerator=worker_accelerator(), devices=world, strategy=strategy, precision=opts.get("precision", "32-true"))
    fabric.launch()
    pl.seed_everything(0)
    net = build(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    net, opt = fabric.setup(net, opt)
    engine = fabric.strategy.engines[0]
    if opts.get("twostep") == "1":
        use_two_steps(engine)
    writes = {"copied": 0, "added": 0}
    count_shard_writes(engine, writes)
    accum = int(opts.get("accum", 1))
    non_root = sum(u.numel for u in engine.units[1:]) * engine.compute_dtype.itemsize
    data = torch.randint(0, VOCAB, (64, GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(1))
    weights0 = {k: v.float().cpu().clone() for k, v in fabric.strategy.full_state_dict().items()}
    losses, weights, traffic, secondary = [], [], [], 0
    for step in range(int(opts.get("steps", 4))):
        before = engine.traffic.snapshot()
        x = data[step, fabric.global_rank :: world].to(fabric.device)
        for micro in x.chunk(accum):
            loss = loss_of(model, net, micro)
            secondary = max(secondary, engine.zpp.secondary_bytes())  # forward done: every unit's copy kept
            fabric.backward(loss / accum)
        opt.step()
        opt.zero_grad()
        after = engine.traffic.snapshot()
        traffic.append({k: after[k] - before.get(k, 0) for k in after})
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        weights.append({k: v.float().cpu().clone() for k, v in fabric.strategy.full_state_dict().items()})
    left = engine.zpp.secondary_bytes()  # after the step: none kept
    full = fabric.strategy.full_state_dict()  # from the fp32 masters
    with fabric.strategy.gathered_params():  # exact even under qwZ (user code reads and writes back these)
        named = [(n, p) for n, p in net.module.named_parameters() if n in full]
        gathered_exact = bool(named) and all(torch.equal(p.detach(), full[n].to(p.device, p.dtype)) for n, p in named)
    return {"losses": losses, "weights0": weights0, "weights": weights, "traffic": traffic, "secondary_bytes": secondary,
            "secondary_left": left, "gathered_exact": gathered_exact, "non_root_bytes": non_root, "world": world,
            "shard_writes": writes}


def run_all(runs: dict[str, str], out: str) -> None:
    for name, spec in runs.items():
        result = run(name, spec)
        if int(os.environ["RANK"]) == 0:
            save_atomic(result, os.path.join(out, f"{name}.pt"))
        torch.distributed.barrier()
