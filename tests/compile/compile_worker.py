"""Scenario ``compile.compile`` (tests/helpers/harness.py): trains the example GPT (tiny) with torch.compile under several strategies.

Runs ``{NAME: SPEC}`` (``run_worker``);
SPEC is ``kind[:key=value,...]`` with kind ``ddp`` or ``zeroK``. Keys: compile (how the network is
compiled: ``net`` = ``self.model = torch.compile(self.model)``, ``netfull`` = the same with
fullgraph=True, ``method`` = ``self.model.compile()``, ``blocks`` = each block ``.compile(fullgraph=True)``,
``strategy`` = ``ZeroStrategy(compile=True)``, ``example`` = the example's ``GPTConfig(compile=True)``
with the backend forced through ``torch.compiler.set_stance``, ``none``), backend (``aot_eager`` or ``inductor``),
precision, ac (activation checkpointing: 1), offload (1: optimizer and parameters in host memory),
pp (pipeline stages), steps, net (``seq``: :class:`SequentialBlocks` instead of the GPT); backend
``default`` is torch.compile's own (inductor, named), seen through dynamo's counters only. Rank 0 writes ``OUT/NAME.pt`` with per-step losses of every rank, the
dynamo counters (graph breaks, unique graphs, calls captured), how many times a compiled graph ran
in each step (a counting backend wraps the real one), and the strategy's compile plan.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from gpt import GPTConfig, GPTModule  # noqa: E402
from tests.helpers.worker_io import run_specs, save_result  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402

VOCAB, SEQ, N_LAYER = 64, 16, 3


def counting_backend(inner: str, calls: list[int]) -> Callable[..., Any]:
    """``inner`` (aot_eager or inductor), counting every run of a compiled forward graph in ``calls[0]``."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs)
        else:
            from torch._dynamo.backends.debugging import aot_eager

            compiled = aot_eager(gm, example_inputs)

        def run(*args: Any) -> Any:
            calls[0] += 1
            return compiled(*args)

        return run

    return backend


class CompiledGPT(GPTModule):
    """The example GPT, compiled the way ``how`` says, recording per-step losses and compiled-graph runs."""

    def __init__(self, how: str, backend: Callable[..., Any], calls: list[int], ac: bool, pipeline: bool) -> None:
        cfg = GPTConfig(vocab_size=VOCAB, n_layer=N_LAYER, n_head=2, d_model=32, seq_len=SEQ, activation_checkpointing=ac,
                        compile=how == "example")
        super().__init__(cfg, lr=3e-3, warmup_steps=1, pipeline=pipeline)
        self.calls = calls
        self.losses: list[float] = []
        self.graph_runs: list[int] = []
        if how in ("net", "netfull"):
            self.model = torch.compile(self.model, backend=backend, fullgraph=how == "netfull")
        elif how == "method":
            self.model.compile(backend=backend)
        elif how == "blocks":
            for block in self.model.blocks:
                block.compile(backend=backend, fullgraph=True)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        before = self.calls[0]
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        self.graph_runs.append(self.calls[0] - before)  # forward graphs (recomputations run in backward)
        return loss

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4, shuffle=False)


class SequentialBlocks(pl.LightningModule):
    """``self.net = torch.compile(net)`` of a network made of ``nn.Sequential(Linear, GELU, Linear)``
    blocks (timm/torchvision style): stage 3's units are the Linears, modules of torch.nn itself, which
    a compile through ``_call_impl`` skipped (issue #27 item 2: nothing compiled under zero3)."""

    def __init__(self, backend: Any, calls: list[int]) -> None:
        super().__init__()
        from torch import nn

        def block(d: int) -> nn.Module:
            return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        net = nn.Sequential(nn.Sequential(block(8), block(8)), nn.LayerNorm(8), nn.Linear(8, 4))
        self.net = torch.compile(net, backend=backend)
        self.calls = calls
        self.losses: list[float] = []
        self.graph_runs: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        before = self.calls[0]
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.losses.append(float(loss.detach()))
        self.graph_runs.append(self.calls[0] - before)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)),
                          batch_size=4, shuffle=False)


def run(name: str, spec: str, out: str) -> None:
    kind, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    how = opts.get("compile", "net")
    calls = [0]
    backend: Any = counting_backend(opts.get("backend", "aot_eager"), calls)
    if opts.get("backend") == "default":  # torch.compile's own default (inductor by name): dynamo's counters only
        backend = "inductor"
    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, workers=True)
    pp = int(opts.get("pp", 1))
    if opts.get("net") == "seq":
        model: Any = SequentialBlocks(backend, calls)
    else:
        model = CompiledGPT(how if how != "strategy" else "none", backend, calls, opts.get("ac") == "1", pipeline=pp > 1)
    if kind == "ddp":
        strategy: Any = DDPStrategy()
    else:
        extra: dict[str, Any] = {}
        if how == "strategy":
            extra = {"compile": True, "compile_options": {"backend": backend, "fullgraph": True}}
        if opts.get("offload") == "1":
            extra.update(offload_optimizer="cpu", offload_params="cpu")
        if pp > 1:
            extra.update(pipeline_stages=pp, microbatches=2)
        stage = int(kind[-1])
        if stage == 3:
            extra["param_persistence_threshold"] = 0
        strategy = lightning_zero.ZeroStrategy(stage=stage, bucket_size_mb=0.002, **extra)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
        max_steps=int(opts.get("steps", 6)), precision=opts.get("precision", "32-true"), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    if how == "example":
        with torch.compiler.set_stance("default", force_backend=backend):
            trainer.fit(model)
    else:
        trainer.fit(model)
    plan = getattr(trainer.strategy, "compile_plan", None)
    result = {
        "losses": model.losses,
        "graph_runs": model.graph_runs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": {k.splitlines()[0]: v for k, v in counters["graph_break"].items()},
        "unique_graphs": counters["stats"]["unique_graphs"],
        "calls_captured": counters["stats"]["calls_captured"],
        "plan": None if plan is None else {"compiled": plan.compiled, "made_eager": plan.made_eager,
                                           "already_compiled": plan.already_compiled,
                                           "compiled_around": plan.compiled_around},
        "units": [u.name for u in trainer.strategy.engines[0].units[1:]] if kind == "zero3" else [],
    }
    per_rank = {"losses": model.losses, "graph_runs": model.graph_runs,  # dynamo's own counters, on every rank
                "calls_captured": counters["stats"]["calls_captured"], "graph_breaks": result["graph_breaks"]}
    save_result(result, per_rank, out, name)



@scenario("compile.compile")
def runs(ctx: ScenarioContext) -> None:
    run_specs(run, ctx)
