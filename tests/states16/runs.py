"""ParityNet runs under ``state_precision`` on every rank of a process group (scenario ``states16.runs``).

Spec ``KIND:key=value,...``; keys: stage, sp (state_precision), every (ParityNet.sometimes_every: 4 leaves
``sometimes`` unused on both of two ranks in some steps, so the unused-parameter plan steps pieces), ckpt
(checkpoint_format), from (a run name whose epoch-0 checkpoint this run resumes), n (ParityNet's n_train:
n / 8 steps in two epochs), val (validation batches per epoch; a checkpoint saved at a train epoch end of
a run without validation resumes one micro-batch out of step with its accumulation window, under Lightning's
own ddp too: the checkpoint runs validate), precision (default bf16-mixed), gs (grad_shard_precision), acc
(accumulate_grad_batches, default 2), zpp (ZeRO++'s int8 qwZ and qgZ, stage 3). Kinds:

- ``train``: 6 optimizer steps (accumulation 2, clipping, ParityNet's LR schedule), recording the bytes of
  this rank's partition by storage and, for 16-bit states, :class:`Oracle`'s step-by-step comparison;
- ``save``: 2 epochs of n / 16 steps, a checkpoint at each epoch end, this rank's states at the end of epoch 0
  and at the end;
- ``load``: resumes the epoch-0 checkpoint of run ``from`` and records the states as loaded (at
  ``on_train_start``) and at the end.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.offload.cpu import adam_hyper  # noqa: E402
from lightning_zero.optim import bf16_step  # noqa: E402
from lightning_zero.optim.reference_lowp import adam_bf16_reference  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.helpers.parity_model import ParityNet  # noqa: E402

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_comp")


def _engine(trainer: pl.Trainer) -> Any:
    (engine,) = list(trainer.strategy.engines)
    return engine


def snapshot(engine: Any) -> list[dict[str, Any]]:
    """Every group's master and Adam state on this rank, cloned to the CPU."""
    out = []
    for fg in engine.groups:
        st = engine.optimizer.state.get(fg.master, {})
        snap = {"master": fg.master.detach().cpu().clone(), "step": float(st["step"]) if "step" in st else None}
        snap.update({k: st[k].detach().cpu().clone() for k in STATE_KEYS if k in st})
        out.append(snap)
    return out


class Oracle:
    """Replays every step of the engine's 16-bit states with the reference (optim/reference_lowp.py) on CPU
    copies that start from the model's *initial* fp32 weights, and counts the elements where the engine's
    master, compensation or moments differ after each step. What it takes from the engine: each step's
    gradient shard, unscale/clip coefficient, hyper-parameters and unused-parameter plan; what it computes
    itself: the initial bf16 master and Kahan word, which flat index (random bits) each element has, the
    step counts."""

    def __init__(self, engine: Any, initial: dict[int, torch.Tensor]) -> None:
        self.engine = engine
        self.kahan = engine.states16.kahan
        self.sim = []
        for fg in engine.groups:
            n = fg.layout.shard_numel
            value = torch.zeros(n)
            for index, start, shard_start, length in fg.layout.param_pieces_in_shard(fg.shard):
                source = initial[id(fg.params[index])].reshape(-1)
                value[shard_start : shard_start + length] = source[start : start + length]
            master = value.bfloat16()
            comp = (value - master.float()).bfloat16() if self.kahan else None
            self.sim.append([master, comp, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)])
        self.counts = [0] * len(engine.groups)
        self.mismatches: list[int] = []
        self.kept_pieces = 0
        original = engine.states16.step

        def step(grads: Any, coef: float, plans: Any) -> None:
            hypers = [adam_hyper(engine.optimizer, engine.optimizer.param_groups[pi]) for pi in engine.pg_of]
            cpu_grads = [g.detach().float().cpu().clone() for g in grads]
            original(grads, coef, plans)
            self._replay(cpu_grads, coef, plans, hypers)

        engine.states16.step = step

    def _replay(self, grads: list, coef: float, plans: Any, hypers: list) -> None:
        bad = 0
        for gi, (fg, sim, grad, hyper) in enumerate(zip(self.engine.groups, self.sim, grads, hypers)):
            plan = plans[gi] if plans is not None else None
            if plan is not None and not plan.stepped:
                continue
            if plan is None:
                self.counts[gi] += 1
                ranges = [(0, fg.layout.shard_numel, self.counts[gi])]
            else:
                self.counts[gi] = plan.steps
                ranges = plan.ranges
                self.kept_pieces += len(plan.kept)
            for lo, hi, count in ranges:
                for b in fg.layout.buckets:  # each bucket's chunk is contiguous in the flat buffer
                    a, z = max(lo, b.shard_offset), min(hi, b.shard_offset + b.chunk)
                    if a >= z:
                        continue
                    offset = b.start + fg.shard * b.chunk + (a - b.shard_offset)
                    master, comp, m, v = (None if t is None else t[a:z] for t in sim)
                    adam_bf16_reference(master, comp, grad[a:z], m, v, None, step=count, lr=hyper.lr,
                                        beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
                                        weight_decay=hyper.weight_decay, adamw_mode=hyper.adamw_mode,
                                        grad_scale=1.0 / coef, seed=gi, offset=offset)
            now = snapshot(self.engine)[gi]
            pairs = [(now["master"], sim[0]), (now["exp_avg"], sim[2]), (now["exp_avg_sq"], sim[3])]
            if self.kahan:
                pairs.append((now["master_comp"], sim[1]))
            bad += sum(int((x.view(torch.int16) != y.view(torch.int16)).sum()) for x, y in pairs)
        self.mismatches.append(bad)


class Probe(pl.Callback):
    """Bytes of the partition by storage after each step; states at epoch ends and at the start of training."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = {}
        self.epoch_states: list[Any] = []
        self.start_states: Optional[list] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_states = snapshot(_engine(trainer))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        engine = _engine(trainer)
        numel = sum(fg.layout.shard_numel for fg in engine.groups)
        shards = [fg.grad_shard for fg in engine.groups if fg.grad_shard is not None]
        self.bytes["grads"] = storage_bytes(shards) / numel

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = _engine(trainer)
        numel = sum(fg.layout.shard_numel for fg in engine.groups)
        held = []
        for fg in engine.groups:
            st = engine.optimizer.state.get(fg.master, {})
            held += [fg.master] + [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        self.bytes["states"] = storage_bytes(held) / numel  # master + Adam moments (+ Kahan word)
        self.bytes["partition"] = storage_bytes(held + engine.param_shards(frozen=False)) / numel  # + 16-bit shard
        self.bytes["state_dtypes"] = sorted({str(t.dtype) for t in held})

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_states.append(snapshot(_engine(trainer)))


def make_trainer(opts: dict[str, str], max_steps: int, callbacks: list) -> pl.Trainer:
    stage = int(opts["stage"])
    strategy = lightning_zero.ZeroStrategy(
        stage=stage, bucket_size_mb=0.002, state_precision=opts["sp"], checkpoint_format=opts.get("ckpt", "sharded"),
        grad_shard_precision=opts.get("gs", "fp32"),
        **({"quantized_weights": "int8", "quantized_gradients": "int8", "quant_block_size": 64} if "zpp" in opts else {}),
        **({"param_persistence_threshold": 0} if stage == 3 else {}),
    )
    return pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
        precision=opts.get("precision", "bf16-mixed"),
        max_steps=max_steps, accumulate_grad_batches=int(opts.get("acc", 2)), gradient_clip_val=0.5,
        logger=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=int(opts.get("val", 0)),
        num_sanity_val_steps=0,
        callbacks=callbacks, use_distributed_sampler=False,
    )


def run(name: str, spec: str, out: str) -> dict[str, Any]:
    kind, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    pl.seed_everything(0, workers=True)
    model = ParityNet(n_train=int(opts.get("n", 32)) if kind != "train" else 512)
    model.sometimes_every = int(opts.get("every", 2))
    initial = {id(p): p.detach().clone() for p in model.parameters()}
    probe = Probe()
    result: dict[str, Any] = {}
    if kind == "train":
        trainer = make_trainer(opts, 6, [probe])
        oracle: list[Oracle] = []

        class Attach(pl.Callback):
            def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                if _engine(trainer).states16 is not None:
                    oracle.append(Oracle(_engine(trainer), initial))

        trainer.callbacks.append(Attach())
        bf16_step.CHUNK = 100  # several chunks per bucket piece (the default is 2^20 elements)
        trainer.fit(model)
        if oracle:
            result.update(mismatches=oracle[0].mismatches, kept_pieces=oracle[0].kept_pieces)
    elif kind == "save":
        saver = ModelCheckpoint(dirpath=os.path.join(out, f"{name}_ckpt"), every_n_epochs=1, save_top_k=-1,
                                save_on_train_epoch_end=True)
        trainer = make_trainer(opts, int(opts.get("n", 32)) // 8, [probe, saver])
        trainer.fit(model)
        result["epoch_states"] = probe.epoch_states
    else:
        src = os.path.join(out, f"{opts['from']}_ckpt")
        first = sorted(f for f in os.listdir(src) if f.startswith("epoch=0"))[0]
        trainer = make_trainer(opts, int(opts.get("n", 32)) // 8, [probe])
        trainer.fit(model, ckpt_path=os.path.join(src, first))
        result["start_states"] = probe.start_states
    result.update(losses=list(model.losses), bytes=probe.bytes, end_states=snapshot(_engine(trainer)))
    return result
