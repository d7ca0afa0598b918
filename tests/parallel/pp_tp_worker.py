"""Scenario ``parallel.pp_tp`` (tests/helpers/harness.py): pipeline x tensor parallel x ZeRO-1 (tests/parallel/pp_tp_model.py).

Runs ``{NAME: SPEC}`` (``run_worker``), SPEC
``key=value`` pairs joined by ``,``: pp, tp, stage (ZeRO), micro, schedule, virtual (virtual_stages of
schedule=interleaved; the model is then cut in pp_tp_model.INTERLEAVED_PARTITION), precision, steps, clip, fmt
(checkpoint_format), save=ID (train save_at=3 steps, save ``OUT/ID.ckpt``; rank 0 consolidates a sharded
one), resume=ID (train to ``steps`` from ``OUT/ID.ckpt``, in this run's layout). Rank 0 writes ``OUT/NAME.pt``:
per-step losses, gradient norms, full weights (each rank's TP blocks gathered over tp, the stages'
names merged) and every rank's coordinates and model chunk count.
"""

from __future__ import annotations

import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.checkpoint import load_consolidated  # noqa: E402
from tests.helpers.worker_io import run_specs, save_result  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.parallel.pp_tp_model import INTERLEAVED_PARTITION, PPTPNet  # noqa: E402
from tests.pipeline.pipe_model import GradNormProbe  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402


def make_trainer(opts: dict[str, str], callbacks: list) -> pl.Trainer:
    strategy = lightning_zero.ZeroStrategy(checkpoint_format=opts.get("fmt", "sharded"),
        stage=int(opts.get("stage", 1)), pipeline_stages=int(opts.get("pp", 2)), tensor_parallel=int(opts.get("tp", 2)),
        microbatches=int(opts.get("micro", 4)), schedule=opts.get("schedule", "1f1b"),
        virtual_stages=int(opts.get("virtual", 2)), bucket_size_mb=0.002,
    )
    return pl.Trainer(
        accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=int(opts.get("steps", 6)),
        precision=opts.get("precision", "32-true"), gradient_clip_val=float(opts.get("clip", 0.3)), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=callbacks,
    )


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of every stage at its full value (collective: DTensors gathered over tp, then the
    stages' dicts over all ranks), on the CPU: under ``LZ_TEST_ACCELERATOR=gpu`` the oracle is a CPU run."""
    mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
            for n, p in model.named_parameters()}
    merged: dict[str, torch.Tensor] = {}
    for part in C.all_gather_object(mine, None):
        merged.update(part)
    return merged


def run(name: str, spec: str, out: str) -> None:
    opts = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    pl.seed_everything(0, workers=True)
    model = PPTPNet(partition=INTERLEAVED_PARTITION if opts.get("schedule") == "interleaved" else None)
    probe = GradNormProbe()
    result: dict = {}
    ckpt = opts.get("save") or opts.get("resume")
    if "save" in opts:  # train part of the way, save (sharded or full), consolidate a sharded one on rank 0
        trainer = make_trainer({**opts, "steps": opts.get("save_at", "3")}, [probe])
        trainer.fit(model)
        path = os.path.join(out, f"{ckpt}.ckpt")
        trainer.save_checkpoint(path)
        C.barrier(None)
        if trainer.is_global_zero and os.path.isdir(path):
            result["consolidated"] = load_consolidated(path)["state_dict"]
        result["saved_weights"] = full_weights(model)
        result["full_state_dict"] = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                                     for k, v in trainer.strategy.full_state_dict().items()}
    else:
        trainer = make_trainer(opts, [probe])
        trainer.fit(model, ckpt_path=os.path.join(out, f"{ckpt}.ckpt") if ckpt else None)
    dims = trainer.strategy.dims
    result.update(losses=list(model.losses), grad_norms=list(probe.norms), weights=full_weights(model))
    mine = {"coords": (dims.pp_rank, dims.dp_rank, dims.tp_rank), "tp_params": model.tp_params,
            "chunks": getattr(model.pipe.placement, "chunks", 1),
            "local_numel": sum(p._local_tensor.numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()),
            "losses": list(model.losses)}
    save_result(result, mine, out, name)



@scenario("parallel.pp_tp")
def runs(ctx: ScenarioContext) -> None:
    run_specs(run, ctx)
