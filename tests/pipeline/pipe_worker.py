"""Scenario ``pipeline.pipe`` (tests/helpers/harness.py): trains PipeNet under pipelined ZeroStrategy configurations.

Runs ``{NAME: SPEC}`` (``run_worker``);
SPEC is ``key=value`` pairs joined by ``,``: stages, micro, schedule, virtual, stage (ZeRO stage),
blocks, partition ('uniform' etc.), steps, clip, ckpt (save a checkpoint after fit), fmt (checkpoint_format), resume (checkpoint
at every epoch end; a fresh Trainer resumes from the first and records ``resumed_losses``; with
resume_stages=S it resumes with S pipeline stages),
accumulate, precision, expect (a bad-input case: 'layers' or 'batch'; the error message is recorded),
carry (1: blocks pass a second tensor on unchanged, pipe_model.CarryBlock), count (1: record the allocations and fills of every training step, ``allocations`` per rank), compile (a
torch.compile backend: ``ZeroStrategy(compile=True)`` with it and fullgraph; dynamo's counters per rank).
Rank 0 writes ``OUT/NAME.pt``.
"""

from __future__ import annotations

import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.pipeline import LayerSpec, PipelineModule  # noqa: E402
from tests.helpers.worker_io import run_specs, save_result  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.pipeline.pipe_model import GradNormProbe, PipeNet, RandomTokens, token_loss  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402


class OneLayerNet(PipeNet):
    """A PipelineModule with a single layer: more stages than layers."""

    def __init__(self) -> None:
        super().__init__()
        self.pipe = PipelineModule([LayerSpec(nn.Linear, 4, 4)], token_loss)


def make_trainer(opts: dict[str, str], steps: int, callbacks: list) -> pl.Trainer:
    compiled: dict = {}
    if "compile" in opts:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()  # the counters of this run only
        compiled = {"compile": True, "compile_options": {"backend": opts["compile"], "fullgraph": True}}
    strategy = lightning_zero.ZeroStrategy(
        stage=int(opts.get("stage", 1)),
        pipeline_stages=int(opts.get("stages", 2)),
        microbatches=int(opts.get("micro", 4)),
        schedule=opts.get("schedule", "1f1b"),
        virtual_stages=int(opts.get("virtual", 2)),
        bucket_size_mb=0.002,
        checkpoint_format=opts.get("fmt", "sharded"), **compiled,
    )
    return pl.Trainer(
        accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=steps,
        precision=opts.get("precision", "32-true"), gradient_clip_val=float(opts.get("clip", 0.5)) or None,
        accumulate_grad_batches=int(opts.get("accumulate", 1)), logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=1, limit_val_batches=2, use_distributed_sampler=False,
        callbacks=callbacks,
    )


def make_model(opts: dict[str, str]) -> PipeNet:
    pl.seed_everything(0, workers=True)
    partition = opts.get("partition", "parameters")
    return PipeNet(
        blocks=int(opts.get("blocks", 4)),
        partition=[int(b) for b in partition.split("-")] if "-" in partition else partition,
        checkpoint_interval=int(opts.get("ckpt_interval", 0)), carry=opts.get("carry") == "1",
    )


def run(name: str, spec: str, out: str) -> None:
    opts = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    steps = int(opts.get("steps", 20))
    result: dict = {}
    if "expect" in opts:
        model = OneLayerNet() if opts["expect"] == "layers" else make_model(opts)
        if opts["expect"] == "batch":
            model.global_batch = 6
        try:
            make_trainer(opts, steps, []).fit(model)
            result["error"] = None
        except Exception as err:  # noqa: BLE001 - the message is the result
            result["error"] = f"{type(err).__name__}: {err}"
            result["trained_losses"] = list(getattr(model, "losses", []))
    else:
        model = make_model(opts)
        model.count_allocations = opts.get("count") == "1"
        probe = GradNormProbe()
        callbacks: list = [probe]
        ckpt_dir = os.path.join(out, f"{name}_ckpt")
        if "resume" in opts:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True))
        trainer = make_trainer(opts, steps, callbacks)
        trainer.fit(model)
        result.update(
            losses=list(model.losses), val_losses=list(model.val_losses), grad_norms=list(probe.norms),
            bubble=trainer.strategy.pipeline_bubble,
            weights=trainer.strategy.full_state_dict(),
            local_keys=sorted(model.state_dict().keys()),
        )
        if "ckpt" in opts:
            path = os.path.join(out, f"{name}.ckpt")
            trainer.save_checkpoint(path)
            result["ckpt"] = path
            with torch.no_grad():  # outputs of the last layer, computed by the last stage, on every rank
                result["predict"] = model.pipe.predict(RandomTokens(6, seed=5).data[:, :-1]).to("cpu", copy=True)  # beside a CPU oracle
        if "resume" in opts:
            first = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("epoch=0"))[0]
            again = make_model(opts)
            layout = {**opts, "stages": opts.get("resume_stages", opts.get("stages", "2"))}  # another layout
            make_trainer(layout, steps, []).fit(again, ckpt_path=os.path.join(ckpt_dir, first))
            result["resumed_losses"] = list(again.losses)
    result["allocations"] = list(getattr(model, "allocations", []))
    if "compile" in opts:
        from torch._dynamo.utils import counters

        plan = trainer.strategy.compile_plan
        result.update(compiled=list(plan.compiled) if plan is not None else [],
                      calls_captured=counters["stats"]["calls_captured"],
                      graph_breaks=sum(counters["graph_break"].values()))
    keys = ("losses", "val_losses", "error", "local_keys", "bubble", "grad_norms", "predict", "resumed_losses",
            "allocations", "compiled", "calls_captured", "graph_breaks")
    save_result(result, {k: result.get(k) for k in keys}, out, name)



@scenario("pipeline.pipe")
def runs(ctx: ScenarioContext) -> None:
    run_specs(run, ctx)
