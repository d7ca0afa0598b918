"""Scenario ``inference.tp_predict`` (tests/helpers/harness.py): ``predict`` with ``tensor_parallel=2`` (issue #31).

Each run ``"<kind>:<stage>"`` builds the model in ``__init__`` (the same seed in every process, so the plain
model of each rank is tp 1's model), applies the ready TP plan (lightning_zero.parallel) to
``self.device_mesh["tp"]`` in ``configure_model``, and predicts without ``fit``: logits of every batch, and
``generate`` (greedy, with the KV cache; and compiled with the static cache, which stage 3 refuses) of each
batch's prompts. Each rank records the largest difference
of its logits from the plain model's and both token tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import lightning.pytorch as pl
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.inference import DecodeConfig, generate
from lightning_zero.parallel import parallelize, tp_plan_gpt, tp_plan_llama
from tests.helpers.harness import ScenarioContext, scenario
from tests.helpers.launch import worker_accelerator
from tests.inference.predict_runs import VOCAB, build, logits_of

TOKENS = 4


class TPPredict(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.model = build(kind)
        self.parallelized = False

    def configure_model(self) -> None:
        if self.parallelized:  # configure_model runs again for every loop
            return
        tp = self.device_mesh["tp"]
        plan = tp_plan_llama(self.model, tp) if self.kind == "llama" else tp_plan_gpt(self.model, tp)
        parallelize(self.model, tp, plan)
        self.parallelized = True

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0]
        logits = logits_of(self.kind, self.model, x)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        try:  # the compiled decode (traced, not code-generated: cheap); refused under stage 3 (None)
            compiled = generate(self.model, x[:, :6], TOKENS, compile=DecodeConfig(backend="eager"))
        except ValueError as err:
            if "stage 3" not in str(err):
                raise
            compiled = None
        return {"x": x, "logits": logits, "tokens": generate(self.model, x[:, :6], TOKENS), "compiled": compiled,
                "sharded": sum(isinstance(p, DTensor) for p in self.model.parameters())}


@scenario("inference.tp_predict")
def tp_predict(ctx: ScenarioContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(2)
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (4, 10), generator=g)), batch_size=2)
    for spec in ctx.params["runs"]:
        kind, stage = spec.split(":")
        module = TPPredict(kind)
        plain = build(kind)
        trainer = pl.Trainer(accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]),
                             strategy=ZeroStrategy(stage=int(stage), tensor_parallel=2), logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        results = trainer.predict(module, data)
        rows = []
        with torch.no_grad():
            for r in results:
                x = r["x"].cpu()
                rows.append({"diff": float((r["logits"].cpu() - logits_of(kind, plain, x)).abs().max()),
                             "tokens": r["tokens"].cpu(), "plain_tokens": generate(plain, x[:, :6], TOKENS),
                             "sharded": r["sharded"],
                             "compiled": None if r["compiled"] is None else r["compiled"].cpu()})
        out[spec] = {"rows": rows, "engines": [type(e).__name__ for e in trainer.strategy.engines]}
        ctx.record("partial", out)
    return out
