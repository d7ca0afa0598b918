"""Scenario ``user_optim.parity`` (scenarios.py): the user's own torch optimizer, param groups and LR scheduler
under Lightning's ddp (``find_unused_parameters=True``) and each ZeRO stage, in one process group.

Each case names an optimizer (``OPTIMIZERS``), a scheduler (``SCHEDULERS``) and whether the model skips
parameters (``skip``: a block unused on every rank on odd steps, another on rank 1 only every third step, a
side layer on even steps only). The param groups are nanoGPT's: weights with weight decay, biases and
LayerNorm without, the second with its own lr (and betas/eps/momentum where the optimizer has them), so a
scheduler or option that edits one group's fields is seen. Rank 0 saves ``OUT/<case>__<kind>.pt``: per-step
losses, final weights, the optimizer state after the run and the error text of a run that refused.
``resume``: the run stops after ``steps // 2`` steps (checkpoint, ``ckpt``: sharded or full; ``first``: taken by
another kind, e.g. ddp), a fresh Trainer resumes to ``steps``. ``late``: the side layer is first used after that.
``keep_grads``: the module's ``optimizer_zero_grad`` calls ``zero_grad(set_to_none=False)``. ``hook``: the module
overrides a Lightning hook the way its docs or a library show (``HOOKS``): ``warmup`` (``optimizer_step`` sets each
group's lr after the step: Lightning's warm-up recipe), ``every_other`` (``optimizer_step`` steps on even batches
and only runs the closure on odd ones, whose gradients the next closure's zero_grad drops), ``timm`` (a scheduler
that is no torch scheduler, stepped by ``lr_scheduler_step`` with the global step: timm's ``step_update``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
from torch import nn

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.worker_io import save_atomic  # noqa: E402

Groups = list[dict[str, Any]]


def _adam_like(cls: type, **kw: Any) -> Callable[[Groups], torch.optim.Optimizer]:
    def make(groups: Groups) -> torch.optim.Optimizer:
        groups[1].update(betas=(0.8, 0.95), eps=1e-6)
        return cls(groups, lr=0.02, **kw)
    return make


def _sgd(**kw: Any) -> Callable[[Groups], torch.optim.Optimizer]:
    def make(groups: Groups) -> torch.optim.Optimizer:
        groups[1].update(momentum=0.5)
        return torch.optim.SGD(groups, lr=0.05, **kw)
    return make


OPTIMIZERS: dict[str, Callable[[Groups], torch.optim.Optimizer]] = {
    "adamw": _adam_like(torch.optim.AdamW),
    "adamw_amsgrad": _adam_like(torch.optim.AdamW, amsgrad=True),
    "adamw_maximize": _adam_like(torch.optim.AdamW, maximize=True),
    "adamw_amsgrad_maximize": _adam_like(torch.optim.AdamW, amsgrad=True, maximize=True, foreach=False),
    "adamw_foreach": _adam_like(torch.optim.AdamW, foreach=True),
    "adamw_fused": _adam_like(torch.optim.AdamW, fused=True),
    "adamw_capturable": _adam_like(torch.optim.AdamW, capturable=True),
    "adamw_differentiable": _adam_like(torch.optim.AdamW, differentiable=True),
    "adam_l2": _adam_like(torch.optim.Adam),
    "adam_decoupled": _adam_like(torch.optim.Adam, decoupled_weight_decay=True),
    "adam_amsgrad_foreach": _adam_like(torch.optim.Adam, amsgrad=True, foreach=True),
    "sgd": _sgd(momentum=0.9),
    "sgd_nesterov": _sgd(momentum=0.9, nesterov=True),
    "sgd_dampening": _sgd(momentum=0.9, dampening=0.3),
    "sgd_plain": _sgd(),
    "rmsprop_centered": lambda g: torch.optim.RMSprop(g, lr=0.01, centered=True, momentum=0.5),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05),
    "nadam_decoupled": lambda g: torch.optim.NAdam(g, lr=0.02, decoupled_weight_decay=True),
    "radam_decoupled": lambda g: torch.optim.RAdam(g, lr=0.02, decoupled_weight_decay=True),
    "adamax": lambda g: torch.optim.Adamax(g, lr=0.02),
    "adadelta": lambda g: torch.optim.Adadelta(g, lr=0.5),
    "asgd": lambda g: torch.optim.ASGD(g, lr=0.02, t0=2),
}


def _onecycle(opt: torch.optim.Optimizer, steps: int) -> dict:
    return {"scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=steps + 2,
                                                             pct_start=0.3), "interval": "step"}


def _cyclic(opt: torch.optim.Optimizer, steps: int) -> dict:
    return {"scheduler": torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.005, max_lr=0.05, step_size_up=3,
                                                           cycle_momentum=True, base_momentum=0.7,
                                                           max_momentum=0.9), "interval": "step"}


def _lambda(opt: torch.optim.Optimizer, steps: int) -> dict:
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0 / (1 + s), lambda s: 0.9 ** s]),
            "interval": "step"}


def _plateau(opt: torch.optim.Optimizer, steps: int) -> dict:
    return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5),
            "interval": "step", "monitor": "train_loss"}


class StepUpdateScheduler:
    """A scheduler written as timm writes its own (no torch ``LRScheduler``): linear warm-up then cosine decay of
    every group's base lr, set by ``step_update(num_updates)``, which Lightning reaches only through
    ``LightningModule.lr_scheduler_step``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, total: int) -> None:
        self.optimizer, self.warmup, self.total = optimizer, warmup, total
        self.base = [g["lr"] for g in optimizer.param_groups]

    def step_update(self, num_updates: int) -> None:
        import math

        t = num_updates
        scale = (t + 1) / self.warmup if t < self.warmup else 0.5 * (1 + math.cos(math.pi * t / self.total))
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * scale

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = state["base"]


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer, int], dict]] = {
    "onecycle": _onecycle, "cyclic": _cyclic, "lambda": _lambda, "plateau": _plateau,
    "timm": lambda opt, steps: {"scheduler": StepUpdateScheduler(opt, warmup=3, total=steps), "interval": "step"},
}
HOOKS = ("", "warmup", "every_other", "timm")
WARMUP_STEPS = 4


class OptNet(pl.LightningModule):
    """Four blocks, a LayerNorm, a side layer and a head; ``skip`` adds the data-dependent control flow."""

    def __init__(self, opt: str, sched: str, skip: bool, steps: int, rank_skip: bool = False,
                 late: bool = False, keep_grads: bool = False, hook: str = "") -> None:
        super().__init__()
        assert hook in HOOKS, hook
        self.hook = hook
        self.late = late
        self.keep_grads = keep_grads
        self.opt, self.sched, self.skip, self.steps, self.rank_skip = opt, sched, skip, steps, rank_skip
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.norm = nn.LayerNorm(8)
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step, rank = self.trainer.global_step, self.global_rank
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        for i, block in enumerate(self.blocks):
            if self.skip and ((i == 1 and step % 2 == 1) or (i == 2 and self.rank_skip and rank == 1 and step % 3 == 0)):
                continue
            x = torch.tanh(block(x))
        x = self.norm(x)
        if (not self.skip or step % 2 == 0) and not (self.late and step < 5):
            x = x + torch.tanh(self.side(x))
        loss = ((self.head(x) - y) ** 2).mean()
        self.losses.append(float(loss))
        self.log("train_loss", loss, sync_dist=not self.skip)  # zero3: see the test module docstring
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=not self.keep_grads)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.hook == "every_other" and batch_idx % 2 == 1:
            optimizer_closure()  # Lightning's rule: a step that is skipped still runs its closure
            return
        optimizer.step(closure=optimizer_closure)
        if self.hook == "warmup" and self.trainer.global_step < WARMUP_STEPS:
            # Lightning's documented warm-up: scale each group's initial lr after the step
            scale = min(1.0, float(self.trainer.global_step + 1) / WARMUP_STEPS)
            for group in optimizer.param_groups:
                group["lr"] = scale * group["initial_lr_of_this_test"]

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if isinstance(scheduler, StepUpdateScheduler):
            scheduler.step_update(self.trainer.global_step)
        else:
            super().lr_scheduler_step(scheduler, metric)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(64, 1), batch_size=1)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        groups: Groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.01}]
        opt = OPTIMIZERS[self.opt](groups)
        for group in opt.param_groups:
            group["initial_lr_of_this_test"] = group["lr"]
            if self.hook == "warmup":
                group["lr"] = group["lr"] / WARMUP_STEPS
        if not self.sched:
            return opt
        return {"optimizer": opt, "lr_scheduler": SCHEDULERS[self.sched](opt, self.steps)}


def strategy_for(kind: str, ckpt: str = "sharded") -> Any:
    if kind == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    stage = int(kind[4])
    extra: dict[str, Any] = {"param_persistence_threshold": 0} if stage == 3 else {}
    if kind.endswith("_offload"):
        extra.update(offload_optimizer="cpu", offload_params="cpu")
    return lightning_zero.ZeroStrategy(stage=stage, bucket_size_mb=0.0005, checkpoint_format=ckpt, **extra)


def _trainer(kind: str, steps: int, ckpt: str = "sharded") -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy_for(kind, ckpt),
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                      )


def run_case(case: str, kind: str, opts: dict[str, Any], out: str) -> None:
    steps = int(opts.get("steps", 8))
    args = (opts.get("opt", "adamw"), opts.get("sched", ""), bool(opts.get("skip", False)), steps, bool(opts.get("rank_skip", False)),
            bool(opts.get("late", False)), bool(opts.get("keep_grads", False)), str(opts.get("hook", "")))
    pl.seed_everything(0)
    model = OptNet(*args)
    result: dict[str, Any] = {"error": ""}
    try:
        if opts.get("resume"):
            half = steps // 2
            trainer = _trainer(opts.get("first", kind), half, opts.get("ckpt", "sharded"))
            trainer.fit(model)
            path = os.path.join(out, f"{case}__{kind}.ckpt")
            trainer.save_checkpoint(path)
            first = list(model.losses)
            pl.seed_everything(0)
            model = OptNet(*args)
            trainer = _trainer(kind, steps, opts.get("ckpt", "sharded"))
            trainer.fit(model, ckpt_path=path)
            model.losses = first + list(model.losses)
        else:
            trainer = _trainer(kind, steps)
            trainer.fit(model)
        result["losses"] = list(model.losses)
        result["weights"] = ({k: v.detach().clone() for k, v in model.state_dict().items()} if kind == "ddp"
                             else trainer.strategy.full_state_dict())
        result["lrs"] = [pg["lr"] for pg in trainer.optimizers[0].param_groups]
    except Exception as err:  # a refusal: its one sentence is what the test reads
        result["error"] = f"{type(err).__name__}: {err}"
        if os.environ.get("LZ_OPTIM_RAISE"):
            raise
    if int(os.environ.get("RANK", "0")) == 0:
        save_atomic(result, os.path.join(out, f"{case}__{kind}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def run(params: dict[str, Any], out: str) -> None:
    for case, opts in params["cases"].items():
        for kind in opts.get("kinds", params["kinds"]):
            run_case(case, kind, opts, out)
