"""The parity runs (scenario ``distributed.parity``, tests/distributed/scenarios.py): ParityNet under several
strategies in one process group.

Writes ``<out>/<name>.pt`` on rank 0 with per-step losses, final full weights and per-rank memory
counts, for each ``{NAME: SPEC}`` of the ``runs`` parameter (``tests.helpers.launch.run_worker``), where SPEC is ``ddp`` or ``zeroK[:key=value,...]``. Keys: precision, accumulate, clip, steps, opt,
bucket_mb, limit (train batches per epoch), n_train (samples per epoch), resume (ModelCheckpoint at
every epoch end; a fresh Trainer resumes from the first and records ``resumed_losses``), inject (global step at which rank 1 makes its loss infinite),
hysteresis (fp16 loss scaler), ckpt (checkpoint_format: sharded or full), autocast=1 (mixed_precision='autocast'); offload: oopt, oparams, nvme=1, chunk_mb, dpu, ratio, hsp (offload_state_precision) (see ``offload_kwargs``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.helpers.parity_model import ParityNet  # noqa: E402
from tests.helpers.worker_io import save_result  # noqa: E402


def parse(spec: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return kind, opts


class MemoryProbe(pl.Callback):
    """Counts optimizer-state and gradient storage on this rank right after backward/step."""

    def __init__(self) -> None:
        self.grad_bytes = 0
        self.state_bytes = 0
        self.trace = []
        self.rest_bytes = 0
        self.max_live_units = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        strategy = trainer.strategy
        tensors = [p.grad for p in pl_module.parameters() if p.grad is not None]
        for engine in getattr(strategy, "engines", []):
            for fg in engine.groups:
                tensors += [t for t in (fg.flat_grad, fg.grad_shard) if t is not None]
        self.grad_bytes = max(self.grad_bytes, storage_bytes(tensors))


    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with contextlib.ExitStack() as stack:  # NVMe offload: masters and states swapped in to be read
            for engine in getattr(trainer.strategy, "engines", []):
                stack.enter_context(engine.host_state())
            self._record_step(trainer, pl_module, outputs, batch, batch_idx)

    def _record_step(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        # what the optimizer holds: the parameters under ddp, this rank's fp32 master shards under ZeRO
        # (ZeRO-3's released parameters must not be read outside a gather)
        engines = getattr(strategy, "engines", [])
        held = [fg.master for e in engines for fg in e.groups] if engines else [
            p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
        checksum = sum(float(p.detach().double().sum()) for p in held)
        states = [v for opt in trainer.optimizers for st in opt.state.values() for v in st.values()]
        state_sum = sum(float(v.double().sum()) for v in states if torch.is_tensor(v) and v.dim() > 0)
        self.trace.append({
            "step": trainer.global_step, "loss_scale": getattr(strategy, "loss_scale", None),
            "skipped": getattr(strategy, "skipped_steps", 0), "params": checksum, "state": state_sum,
            "dtype": str(next(pl_module.parameters()).dtype), "device": batch[0].device.type, "batch": int(batch[0].sum()),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        })
        # model state at rest, after the step: parameters (released ZeRO-3 storage counts 0), masters,
        # 16-bit shards, gradients and optimizer state, each storage once
        rest = list(pl_module.parameters()) + [p.grad for p in pl_module.parameters() if p.grad is not None]
        for engine in getattr(strategy, "engines", []):
            for fg in engine.groups:
                rest += [t for t in (fg.master, getattr(fg, "shard16", None), fg.grad_shard, fg.flat_grad) if t is not None]
            self.max_live_units = max(self.max_live_units, getattr(engine, "max_live_units_seen", 0))
        rest += [v for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        self.rest_bytes = storage_bytes([t for t in rest if t is not None])
        tensors = []
        for opt in trainer.optimizers:
            for st in opt.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        self.state_bytes = max(self.state_bytes, storage_bytes(tensors))


def offload_kwargs(opts: dict[str, str]) -> dict[str, object]:
    """Spec keys oopt/oparams (none|cpu|nvme), nvme (set by ``run`` to a fresh directory), chunk_mb,
    frac (nvme_fraction), dpu (delayed parameter update after that many warm-up steps), ratio (offload_ratio),
    hsp (offload_state_precision)."""
    out: dict[str, object] = {}
    for key, name in (("oopt", "offload_optimizer"), ("oparams", "offload_params")):
        if key in opts:
            out[name] = opts[key]
    if "nvme" in opts:
        out["nvme_path"] = opts["nvme"]
    if "chunk_mb" in opts:
        out["nvme_chunk_mb"] = float(opts["chunk_mb"])
    if "frac" in opts:
        out["nvme_fraction"] = float(opts["frac"])
    if "dpu" in opts:
        out["delayed_param_update"], out["delayed_param_update_warmup"] = True, int(opts["dpu"])
    if "hsp" in opts:
        out["offload_state_precision"] = opts["hsp"]
    if "ratio" in opts:
        out["offload_ratio"] = opts["ratio"] if opts["ratio"] == "auto" else float(opts["ratio"])
    return out


def make_trainer(
    kind: str, opts: dict[str, str], max_steps: int, probe: MemoryProbe, extra: Optional[list] = None
) -> pl.Trainer:
    precision = opts.get("precision", "32-true")
    plugin_kwargs = {}
    if kind == "ddp":
        strategy = DDPStrategy(find_unused_parameters=True)
    else:
        zp = None
        if precision == "16-mixed":  # Lightning maps 16-mixed on CPU to bf16: hand the plugin in directly
            zp = lightning_zero.ZeroPrecision("16-mixed", {"hysteresis": int(opts.get("hysteresis", 2))})
            plugin_kwargs = {}
        stage = int(kind[-1])
        stage3 = (
            {"param_persistence_threshold": int(opts.get("persist", 0)), "prefetch_units": int(opts.get("prefetch", 1))}
            if stage == 3
            else {}
        )
        strategy = lightning_zero.ZeroStrategy(
            stage=stage, bucket_size_mb=float(opts.get("bucket_mb", 0.002)), precision_plugin=zp, **stage3,
            checkpoint_format=opts.get("ckpt", "sharded"), **offload_kwargs(opts),
            **({"nonfinite": opts["nonfinite"]} if "nonfinite" in opts else {}),
            **({"mixed_precision": "autocast"} if opts.get("autocast") == "1" else {}),
        )
        if zp is None:
            plugin_kwargs = {"precision": precision}
    if kind == "ddp":
        plugin_kwargs = {"precision": precision}
    return pl.Trainer(
        accelerator=worker_accelerator(),  # cpu unless LZ_TEST_ACCELERATOR=gpu (tests/helpers/launch.py)
        # per node, as a multi-node launch gives them (tests/distributed/test_multinode.py)
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=int(opts.get("accumulate", 2)),
        gradient_clip_val=float(opts.get("clip", 0.5)) or None,
        limit_train_batches=int(opts["limit"]) if "limit" in opts else None,
        logger=False,
        enable_checkpointing=bool(extra),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=int(opts.get("val_every", 10)),
        num_sanity_val_steps=0,
        callbacks=[probe] + list(extra or []),
        use_distributed_sampler=False,
        **plugin_kwargs,
    )


def run(name: str, spec: str, out: str) -> None:
    kind, opts = parse(spec)
    if "nvme" in opts:  # a fresh swap directory per run; what is left in it after fit is reported
        opts["nvme"] = os.path.join(out, f"{name}_nvme")
        os.makedirs(opts["nvme"], exist_ok=True)
    pl.seed_everything(0, workers=True)
    n_train = int(opts.get("n_train", 512))
    model = ParityNet(optimizer=opts.get("opt", "adamw"), inject_inf_at=int(opts.get("inject", -1)), n_train=n_train)
    probe = MemoryProbe()
    steps = int(opts.get("steps", 30))
    losses: list[float] = []
    resumed: list[float] = []
    ckpt_dir = ""
    if "resume" in opts:
        # Checkpoints written by Lightning's ModelCheckpoint at each epoch end, then a fresh Trainer
        # resumes from the first one and must reproduce the uninterrupted run's later losses.
        ckpt_dir = os.path.join(out, f"{name}_ckpt")
        saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
        trainer = make_trainer(kind, opts, steps, probe, [saver])
        trainer.fit(model)
        losses = list(model.losses)
        first = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("epoch=0"))[0]
        pl.seed_everything(0, workers=True)
        fresh = ParityNet(optimizer=opts.get("opt", "adamw"), n_train=n_train)
        again = make_trainer(kind, opts, steps, MemoryProbe())
        again.fit(fresh, ckpt_path=os.path.join(ckpt_dir, first))
        resumed = list(fresh.losses)
    else:
        trainer = make_trainer(kind, opts, steps, probe)
        trainer.fit(model)
        losses = list(model.losses)
    model.losses = losses
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        weights = trainer.strategy.full_state_dict()
    result = {
        "losses": list(model.losses),
        "weights": weights,
        "grad_bytes": probe.grad_bytes,
        "state_bytes": probe.state_bytes,
        "trace": probe.trace,
        "rest_bytes": probe.rest_bytes,
        "max_live_units": probe.max_live_units,
        "resumed_losses": resumed,
        "ckpt_dir": ckpt_dir,
        "eager_steps": [getattr(e, "eager_steps", None) for e in trainer.strategy.engines] if kind != "ddp" else [],
        "nvme_left": sorted(str(p.relative_to(opts["nvme"])) for p in Path(opts["nvme"]).rglob("*")) if "nvme" in opts else [],
    }
    offload = [getattr(e, "offload_host", None) for e in getattr(trainer.strategy, "engines", [])]
    result["node"] = {"num_nodes": trainer.num_nodes, "node_rank": trainer.node_rank,
                      "offload_ranks_per_node": [o.ranks_per_node for o in offload if o is not None]}
    keys = ("losses", "grad_bytes", "state_bytes", "rest_bytes", "max_live_units", "node")
    save_result(result, {k: result[k] for k in keys}, out, name)

