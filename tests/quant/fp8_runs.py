"""Scenario ``quant.fp8`` (tests/quant/scenarios.py): the example GPT trained with FP8 linears (torchao's
emulated float8: the casts of a GPU run, the matmuls in higher precision) against the same run without, under
zero1/zero2/zero3 on gloo, by a Fabric loop in bf16-mixed.

``runs``: ``{NAME: "zeroK[:key=value,...]"}``, run in order; keys ``fp8`` (a recipe), ``save=1`` (write a
Fabric checkpoint ``OUT/NAME_ckpt`` after the last step), ``load=OTHER`` (load OTHER's checkpoint, model
only, right after setup, and train no step), ``precision`` (default ``bf16-mixed``), ``qwz`` (ZeRO++'s
``quantized_weights``, stage 3). Every run starts from
the same weights and sees the same batches (each rank its rows of a global batch), with AdamW. Rank 0 writes ``OUT/NAME.pt``: the global loss of each
step, the full state dict at the end (fp32 copies), the class names of the Linears after setup, and the
Linear weights' ``id``s before and after setup compared (the conversion kept the user's Parameters).
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

from lightning.fabric import Fabric  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.parity_runs import parse  # noqa: E402
from tests.helpers.worker_io import save_atomic  # noqa: E402

VOCAB, SEQ, GLOBAL, STEPS = 64, 16, 8, 4


def build() -> torch.nn.Module:
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=3, n_head=2, d_model=32, seq_len=SEQ))


def run(name: str, spec: str, out: str) -> dict[str, Any]:
    kind, opts = parse(spec)
    world = int(os.environ["WORLD_SIZE"])
    fp8 = {"fp8": opts["fp8"], "fp8_emulate": True} if "fp8" in opts else {}
    if "qwz" in opts:  # ZeRO++'s quantized weight all-gather under the fp8 linears (stage 3)
        fp8["quantized_weights"] = opts["qwz"]
    strategy = lightning_zero.ZeroFabricStrategy(stage=int(kind[-1]), bucket_size_mb=0.002, **fp8,
                                                 **({"param_persistence_threshold": 0} if kind == "zero3" else {}))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=opts.get("precision", "bf16-mixed"))
    fabric.launch()
    fabric.seed_everything(0)
    net = build()
    ids = [id(m.weight) for m in net.modules() if isinstance(m, torch.nn.Linear)]
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
    net, opt = fabric.setup(net, opt)
    linears = [m for m in net.module.modules() if isinstance(m, torch.nn.Linear)]
    same_params = [id(m.weight) for m in linears] == ids
    losses: list[float] = []
    if "load" in opts:
        fabric.load(os.path.join(out, f"{opts['load']}_ckpt"), {"model": net})
    else:
        data = torch.randint(0, VOCAB, (STEPS, GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(1))
        for step in range(STEPS):
            x = data[step, fabric.global_rank :: world]
            logits = net(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    if opts.get("save") == "1":
        fabric.save(os.path.join(out, f"{name}_ckpt"), {"model": net, "optimizer": opt})
    weights = {k: v.detach().float().cpu().clone() for k, v in fabric.strategy.full_state_dict().items()}
    return {"losses": losses, "weights": weights, "linears": [type(m).__name__ for m in linears],
            "same_params": same_params}


def run_all(runs: dict[str, str], out: str) -> None:
    for name, spec in runs.items():
        result = run(name, spec, out)
        if int(os.environ["RANK"]) == 0:
            save_atomic(result, os.path.join(out, f"{name}.pt"))
        torch.distributed.barrier()
