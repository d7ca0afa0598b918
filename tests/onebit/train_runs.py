"""Scenario ``onebit.train`` (tests/onebit/scenarios.py): the example GPT on the pydoc corpus with
OneBitAdam/OneBitLamb under ``zero0``. Params ``{"cases": [CASE, ...]}``; cases:

* ``converge``: Adam(W) (zero0), OneBitAdam (zero0), LAMB (FusedLamb under Lightning's ddp) and
  OneBitLamb (zero0), ``STEPS`` steps each with 15% warm-up, same seed and data; per-step losses
  and the final validation loss. During one compressed and one warm-up step every collective
  handed to torch.distributed is counted (tests/onebit/bytecount.py).
* ``resume``: OneBitAdam and OneBitLamb for 3 short epochs (compression from step 8), checkpoint
  at every epoch end, then a fresh Trainer resumes from the second checkpoint (mid compression).

Every rank returns the result (recorded as ``result``).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))  # the example's gpt and data modules (tests/unit imports them so too)
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Subset  # noqa: E402

import lightning_zero  # noqa: E402
from data import TextDataModule  # noqa: E402
from gpt import GPT, GPTConfig, lr_lambda  # noqa: E402
from lightning_zero.checkpoint import load_consolidated  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.optim import FusedLamb, OneBitAdam, OneBitLamb  # noqa: E402
from tests.onebit.bytecount import count_collectives  # noqa: E402

STEPS = int(os.environ.get("ONEBIT_STEPS", "300"))
WARMUP_FRACTION = 0.15
MODEL = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=64)
LAMB_LR = float(os.environ.get("ONEBIT_LAMB_LR", "3e-2"))
LR = {"adam": 2e-3, "onebit_adam": 2e-3, "lamb": LAMB_LR, "onebit_lamb": LAMB_LR}


class Module(pl.LightningModule):
    """Next-token cross-entropy of the example GPT with the optimizer under test: decay on Linear
    weights only, linear LR warm-up then cosine (examples/gpt_module.py's schedule)."""

    def __init__(self, kind: str, max_steps: int, freeze_step: int) -> None:
        super().__init__()
        self.model = GPT(MODEL)
        self.kind, self.max_steps, self.freeze_step = kind, max_steps, freeze_step

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).float().view(-1, MODEL.vocab_size), y.reshape(-1))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay = [m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        ids = {id(p) for p in decay}
        groups = [
            {"params": decay, "weight_decay": 0.1},
            {"params": [p for p in self.model.parameters() if id(p) not in ids], "weight_decay": 0.0},
        ]
        common = dict(lr=LR[self.kind], betas=(0.9, 0.95), eps=1e-8)
        if self.kind == "adam":
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, **common)
        elif self.kind == "onebit_adam":
            opt = OneBitAdam(groups, freeze_step=self.freeze_step, **common)
        elif self.kind == "lamb":
            opt = FusedLamb(groups, **common)
        else:
            opt = OneBitLamb(groups, freeze_step=self.freeze_step, **common)
        horizon, warmup = self.max_steps, self.max_steps // 10
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, horizon, 0.1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(pl.Callback):
    """Per-step losses; every collective of chosen steps; the optimizer's own comm_stats."""

    def __init__(self, count_at: tuple[int, ...] = ()) -> None:
        self.losses: list[float] = []
        self.count_at = count_at
        self.counted: dict[int, dict[str, Any]] = {}
        self.stats: list[dict[str, float]] = []
        self._ctx: Optional[Any] = None
        self._counter: Optional[Any] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step + 1 in self.count_at:
            self._ctx = count_collectives()
            self._counter = self._ctx.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        opt = trainer.optimizers[0]
        if hasattr(opt, "comm_stats"):
            self.stats.append(dict(opt.comm_stats))
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
            with count_collectives() as plain:  # a 16-bit all-reduce of the same momentum, counted alike
                C.all_reduce(torch.zeros(numel, dtype=torch.bfloat16), None, "sum")
            c = self._counter
            self.counted[trainer.global_step] = {
                "wire": c.wire, "handed": c.handed, "calls": list(c.calls), "momentum_numel": numel,
                "plain_wire": plain.wire, "plain_handed": plain.handed,
            }
            self._ctx = self._counter = None


def make_trainer(kind: str, max_steps: int, callbacks: list, **kw: Any) -> pl.Trainer:
    strategy = DDPStrategy() if kind == "lamb" else lightning_zero.ZeroStrategy(stage=0)
    return pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=max_steps,
        precision="32-true", gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, **kw,
    )


def data() -> TextDataModule:
    return TextDataModule(seq_len=MODEL.seq_len, batch_size=8)


class FixedOrderData(TextDataModule):
    """``steps_per_epoch`` unshuffled batches per rank: a resumed run sees exactly the batches the
    uninterrupted one saw (Lightning's automatic sampler reshuffles per epoch in a way a resumed run
    does not reproduce, and an epoch cut short by limit_train_batches restarts oddly on resume)."""

    def __init__(self, steps_per_epoch: int) -> None:
        super().__init__(seq_len=MODEL.seq_len, batch_size=8)
        self.steps_per_epoch = steps_per_epoch

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        subset = Subset(self.train_set, range(self.steps_per_epoch * self.cfg.batch_size * kwargs["num_replicas"]))
        sampler = DistributedSampler(subset, shuffle=False, **kwargs)
        return DataLoader(subset, batch_size=self.cfg.batch_size, sampler=sampler, drop_last=True)


def converge() -> dict[str, Any]:
    freeze = int(STEPS * WARMUP_FRACTION)
    out = {}
    for kind in os.environ.get("ONEBIT_KINDS", "adam,onebit_adam,lamb,onebit_lamb").split(","):
        pl.seed_everything(int(os.environ.get("ONEBIT_SEED", "0")), workers=True)
        model = Module(kind, STEPS, freeze)
        probe = Probe(count_at=(freeze - 1, freeze + 5) if kind.startswith("onebit") else ())
        trainer = make_trainer(kind, STEPS, [probe], limit_val_batches=8, val_check_interval=STEPS)
        trainer.fit(model, datamodule=data())
        out[kind] = {
            "losses": probe.losses, "val_loss": float(trainer.callback_metrics["val/loss"]),
            "counted": probe.counted, "stats": probe.stats, "freeze_step": freeze,
            "n_params": sum(1 for p in model.parameters() if p.requires_grad),  # the used mask's bytes
        }
    return out


def resume(out_dir: str) -> dict[str, Any]:
    out = {}
    steps, per_epoch, freeze = 30, 10, 8
    for kind in ("onebit_adam", "onebit_lamb"):
        ckpt_dir = os.path.join(out_dir, f"ckpt_{kind}")
        pl.seed_everything(0, workers=True)
        model, probe = Module(kind, steps, freeze), Probe()
        saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
        fixed = dict(limit_val_batches=1, val_check_interval=per_epoch, use_distributed_sampler=False)
        make_trainer(kind, steps, [probe, saver], **fixed).fit(model, datamodule=FixedOrderData(per_epoch))
        second = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("epoch=1"))[0]
        pl.seed_everything(0, workers=True)
        fresh, again = Module(kind, steps, freeze), Probe()
        make_trainer(kind, steps, [again], **fixed).fit(
            fresh, datamodule=FixedOrderData(per_epoch), ckpt_path=os.path.join(ckpt_dir, second)
        )
        # a sharded checkpoint (the default) read whole, every rank's 1-bit error buffers merged
        saved = load_consolidated(os.path.join(ckpt_dir, second))["optimizer_states"][0]
        out[kind] = {"losses": probe.losses, "resumed": again.losses, "comm_state": saved.get("compressed_comm")}
    return out


def run(out_dir: str, cases: list[str]) -> dict[str, Any]:
    known = {"converge": converge, "resume": lambda: resume(out_dir)}
    result: dict[str, Any] = {name: known[name]() for name in cases}
    result["world"] = int(os.environ["WORLD_SIZE"])
    return result
