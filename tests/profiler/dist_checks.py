"""Scenario ``profiler.dist`` (tests/profiler/scenarios.py; 2 ranks) for issue #19's distributed checks, one
process group for all of them (CI time). Every rank records ``<run>`` (``OUT/<run>.rank<r>.pt``):

* ``prof_zero3``: FlopsProfiler on the example GPT under zero3 (per-module parameter counts, totals);
* ``prof_pipe``: FlopsProfiler under 2 pipeline stages (per-stage report files, per-stage totals);
* ``pld_zero3`` / ``pld_ddp``: ProgressiveLayerDrop (model.pld=true) under zero3 and ddp: plans, losses;
* ``act_zero3`` / ``noact_zero3``: zero3 with and without ``activation_offload``: losses, resident units.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the example's gpt module (the tests import it so too)
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from data import WindowDataset  # noqa: E402
from gpt import GPTModule  # noqa: E402
from lightning_zero.activations import is_checkpointed, offloader_of  # noqa: E402
from lightning_zero.callbacks import ProgressiveLayerDrop  # noqa: E402
from lightning_zero.profiler import FlopsProfiler  # noqa: E402
from tests.helpers.harness import record_path  # noqa: E402
from tests.helpers.worker_io import save_atomic  # noqa: E402

TINY = dict(vocab_size=256, n_layer=4, n_head=2, d_model=16, seq_len=8)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def loader() -> DataLoader:
    tokens = torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(0))
    return DataLoader(WindowDataset(tokens, 8, 8), batch_size=4)


def fit(strategy: Any, model_cfg: dict, steps: int, callbacks: list, out: str, pipeline: bool = False) -> tuple[pl.Trainer, GPTModule]:
    pl.seed_everything(0)
    module = GPTModule(model_cfg, lr=1e-2, warmup_steps=1, max_steps=steps, pipeline=pipeline)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=out,
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader())
    return trainer, module


def zero3(**kw: Any) -> lightning_zero.ZeroStrategy:
    return lightning_zero.ZeroStrategy(stage=3, param_persistence_threshold=0, bucket_size_mb=0.001, timeout_s=120, **kw)


def save(out: str, name: str, rank: int, data: dict) -> None:
    save_atomic(data, str(record_path(Path(out), name, rank)))


def run(out: str) -> None:
    rank = int(os.environ["RANK"])

    # profiler under zero3: per-module parameter counts must be the un-partitioned model's
    prof = FlopsProfiler(profile_step=1, output_file="flops_profile.txt", print_report=False)
    trainer, module = fit(zero3(), TINY, 3, [prof], os.path.join(out, "prof_zero3"))
    assert prof.result is not None and prof.model_totals is not None
    save(out, "prof_zero3", rank, {
        "params": {m.name: m.params for m in prof.result.modules}, "fwd": {m.name: m.fwd_flops for m in prof.result.modules},
        "bwd_flops": prof.result.bwd_flops, "report_path": prof.report_path,
        "storage_released": all(p.untyped_storage().nbytes() == 0 for p in module.model.blocks.parameters()),
        "model_params": prof.model_totals.params,
    })

    # profiler under two pipeline stages: a report per stage
    prof = FlopsProfiler(profile_step=1, print_report=False)
    pipe = lightning_zero.ZeroStrategy(stage=1, pipeline_stages=2, microbatches=2, bucket_size_mb=0.001, timeout_s=120)
    fit(pipe, TINY, 2, [prof], os.path.join(out, "prof_pipe"), pipeline=True)
    assert prof.totals is not None and prof.model_totals is not None
    save(out, "prof_pipe", rank, {
        "stage_params": prof.totals.params, "stage_fwd": prof.totals.fwd_flops, "model_fwd": prof.model_totals.fwd_flops,
        "model_params": prof.model_totals.params, "report_path": prof.report_path,
    })

    # PLD under zero3 and ddp: the same decisions on both ranks; zero3 trains like ddp
    for name, strategy in (("pld_zero3", zero3()), ("pld_ddp", DDPStrategy(find_unused_parameters=True))):
        losses = Losses()
        trainer, module = fit(strategy, dict(TINY, pld=True, pld_theta=0.3, pld_gamma=0.2), 8, [losses], out)
        pld = next(c for c in trainer.callbacks if isinstance(c, ProgressiveLayerDrop))
        save(out, name, rank, {"keep": [p.keep for p in pld.plans], "losses": [float(x) for x in losses.losses]})

    # activation offload under zero3: same losses as without, every unit checkpointed, none made resident
    for name, on in (("act_zero3", True), ("noact_zero3", False)):
        losses = Losses()
        trainer, module = fit(zero3(activation_offload=on), TINY, 4, [losses], out)
        engine = trainer.strategy.engines[0]
        units = [u for u in engine.units[1:]]
        offloader = offloader_of(units[0].module) if on else None
        save(out, name, rank, {
            "losses": [x for x in losses.losses], "checkpointed": [is_checkpointed(u.module) for u in units],
            "resident": [u.resident for u in units], "packed": offloader.stats.packed if offloader else 0,
        })

