"""Scenario ``callbacks.train`` (tests/helpers/harness.py): Lightning callbacks and Trainer flags that change
the optimizer or the parameters mid-training, run under Lightning's ``ddp`` and each ZeRO stage in one
process group.

Params: ``{"runs": {CASE: [SPEC, ...], ...}}`` (CASE a key of :data:`CASES`, SPEC ``ddp`` or one of
:func:`make_strategy`'s ZeRO specs). For each case and spec in turn, everything seeded identically first, rank 0 records
``<case>.<spec>`` (``OUT/<case>.<spec>.rank0.pt``) as soon as that run is over, holding:

* ``error``: None, or each rank's traceback;
* ``per_rank``: each rank's training losses (one per batch), and what the case adds (``extra``);
* ``weights``: the final full state dict (ddp: ``model.state_dict()``; ZeRO: ``full_state_dict()``).

A failed run (ZeRO refusing, say) does not stop the next one: the ranks meet at a barrier and go on.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.harness import barrier_or_exit, ScenarioContext, scenario  # noqa: E402

TIMEOUT_S = 90
"""A run whose ranks stop meeting in collectives fails after this long instead of hanging CI."""
N_TRAIN = 56
"""Samples; 2 ranks x batch 4: 7 batches per epoch per rank (not a multiple of 3: the last
accumulation of an epoch is partial)."""
BATCH = 4


def make_strategy(spec: str, find_unused: bool = False) -> Any:
    timeout = {"timeout_s": float(TIMEOUT_S)}
    if spec == "ddp":
        return DDPStrategy(find_unused_parameters=find_unused, timeout=timedelta(seconds=TIMEOUT_S))
    if spec in ("zero1", "zero2"):
        return lightning_zero.ZeroStrategy(stage=int(spec[-1]), bucket_size_mb=0.0005, **timeout)
    if spec == "zero2_partial":  # half of each optimizer partition stepped on the "device"
        return lightning_zero.ZeroStrategy(stage=2, offload_optimizer="cpu", offload_ratio=0.5, bucket_size_mb=0.0005,
                                           **timeout)
    if spec == "zero3":
        return lightning_zero.ZeroStrategy(stage=3, param_persistence_threshold=0, **timeout)
    if spec == "zero3_offload":
        return lightning_zero.ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="cpu",
                                           param_persistence_threshold=0, **timeout)
    raise ValueError(f"unknown spec {spec!r}")


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 3, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 3, generator=g))


class Net(pl.LightningModule):
    """A backbone (two Linear layers) and a head; AdamW with weight decay, so a parameter stepped with a
    zero gradient (instead of being skipped) still moves and shows."""

    def __init__(self, lr: float = 1e-2, batch_size: int = BATCH, freeze_backbone: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        if freeze_backbone:
            self.backbone.requires_grad_(False)
        self.lr = lr
        self.batch_size = batch_size
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.test_losses: list[float] = []
        self.epoch_hook: Optional[Callable[["Net"], None]] = None
        self.trainable_only = False

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.test_losses.append(float(loss))
        self.log("test_loss", loss, sync_dist=True)

    def on_train_epoch_start(self) -> None:
        if self.epoch_hook is not None:
            self.epoch_hook(self)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad] if self.trainable_only else self.parameters()
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1)

    def _loader(self, n: int, seed: int, batch_size: int) -> DataLoader:
        data = _data(n, seed)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        return DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, shuffle=False, **kwargs))

    def train_dataloader(self) -> DataLoader:
        return self._loader(N_TRAIN, 1, self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._loader(16, 2, BATCH)

    def test_dataloader(self) -> DataLoader:
        return self._loader(16, 3, BATCH)


def _trainer(spec: str, find_unused: bool = False, **kwargs: Any) -> pl.Trainer:
    base: dict[str, Any] = dict(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=make_strategy(spec, find_unused),
        precision="32-true", max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    base.update(kwargs)
    return pl.Trainer(**base)


def _weights(trainer: pl.Trainer, model: Net, spec: str) -> dict[str, Tensor]:
    if spec == "ddp":
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return trainer.strategy.full_state_dict()


# ------------------------------------------------------------------ the cases
# Each: (spec, out_dir) -> (model, trainer, extra). The trainer has trained when it returns.

def case_freeze_midway(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    """``requires_grad_(False)`` by hand at the start of epoch 1 on a layer trainable at setup."""
    model = Net()

    def hook(m: Net) -> None:
        if m.current_epoch == 1:
            m.backbone[0].requires_grad_(False)

    model.epoch_hook = hook
    trainer = _trainer(spec, find_unused=True)
    trainer.fit(model)
    return model, trainer, {}


def case_freeze_then_unfreeze(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    """A layer trainable at setup frozen by hand for epoch 1 only (its Adam state resumes at epoch 2)."""
    model = Net()

    def hook(m: Net) -> None:
        m.backbone[2].requires_grad_(m.current_epoch != 1)

    model.epoch_hook = hook
    trainer = _trainer(spec, find_unused=True)
    trainer.fit(model)
    return model, trainer, {}


def case_ema(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = Net()
    trainer = _trainer(spec, max_epochs=2, callbacks=[EMAWeightAveraging(decay=0.8)])
    trainer.fit(model)
    return model, trainer, {}


def case_accumulation_scheduler(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    """``accumulate_grad_batches`` 1 in epoch 0, 3 from epoch 1 (7 batches: a partial window per epoch)."""
    model = Net()
    trainer = _trainer(spec, max_epochs=3, callbacks=[GradientAccumulationScheduler({0: 1, 1: 3})])
    trainer.fit(model)
    return model, trainer, {"global_step": trainer.global_step}


def case_pruning(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = Net()
    trainer = _trainer(spec, max_epochs=3, callbacks=[ModelPruning("l1_unstructured", amount=0.3, verbose=0)])
    trainer.fit(model)
    return model, trainer, {}


def case_unfreeze_midway(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    """A layer frozen at setup (listed in the optimizer) unfrozen by hand at the start of epoch 1."""
    model = Net()
    model.backbone[0].requires_grad_(False)

    def hook(m: Net) -> None:
        if m.current_epoch == 1:
            m.backbone[0].requires_grad_(True)

    model.epoch_hook = hook
    trainer = _trainer(spec, find_unused=True)
    trainer.fit(model)
    return model, trainer, {}


class _Finetune(BackboneFinetuning):
    pass


def case_backbone_finetuning(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = Net()
    model.trainable_only = True
    trainer = _trainer(spec, find_unused=True, callbacks=[_Finetune(unfreeze_backbone_at_epoch=1, verbose=False)])
    trainer.fit(model)
    return model, trainer, {}


def case_swa(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = Net()
    trainer = _trainer(spec, max_epochs=4, callbacks=[StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=2)])
    trainer.fit(model)
    return model, trainer, {}


def _clip_case(algorithm: str) -> Callable[[str, Path], tuple[Net, pl.Trainer, dict]]:
    def case(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
        model = Net(lr=3e-2)
        clip = {"norm": dict(gradient_clip_val=0.02, gradient_clip_algorithm="norm"),
                "value": dict(gradient_clip_val=0.002, gradient_clip_algorithm="value")}.get(algorithm, {})
        trainer = _trainer(spec, max_epochs=2, accumulate_grad_batches=3, **clip)
        trainer.fit(model)
        return model, trainer, {"global_step": trainer.global_step}

    return case


class _TorchClip(Net):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.02)


class _GradEdit(Net):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.1)


class _ModuleClip(Net):
    """Lightning's documented override: clip through ``self.clip_gradients``, from epoch 1 on only."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.current_epoch >= 1:
            self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="norm")

    def on_before_optimizer_step(self, optimizer: Any) -> None:  # reads only what a placeholder allows
        self.grads_present = sum(p.grad is not None for p in self.parameters())


def case_module_clip(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = _ModuleClip(lr=3e-2)
    trainer = _trainer(spec, max_epochs=2)
    trainer.fit(model)
    return model, trainer, {"grads_present": model.grads_present}


class _Manual(Net):
    """Manual optimization, two micro-batches per step (a forward after a backward), then a clip."""

    def __init__(self, torch_clip: bool) -> None:
        super().__init__(lr=3e-2)
        self.automatic_optimization = False
        self.torch_clip = torch_clip

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        losses = []
        for half in (slice(0, 2), slice(2, 4)):
            loss = torch.nn.functional.mse_loss(self(x[half]), y[half]) / 2
            self.manual_backward(loss)
            losses.append(float(loss.detach()))
        self.losses.append(sum(losses))
        if self.torch_clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.02)
        else:
            self.clip_gradients(opt, gradient_clip_val=0.02, gradient_clip_algorithm="norm")
        opt.step()


def _manual_case(torch_clip: bool) -> Callable[[str, Path], tuple[Net, pl.Trainer, dict]]:
    def case(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
        model = _Manual(torch_clip)
        trainer = _trainer(spec, max_epochs=1)
        trainer.fit(model)
        return model, trainer, {}

    return case


def case_torch_clip(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = _TorchClip(lr=3e-2)
    trainer = _trainer(spec, max_epochs=2)
    trainer.fit(model)
    return model, trainer, {}


def case_grad_edit(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = _GradEdit(lr=3e-2)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.3)  # type: ignore[method-assign]
    trainer = _trainer(spec, max_epochs=2)
    trainer.fit(model)
    return model, trainer, {}


def case_lr_find(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = Net()
    trainer = _trainer(spec, max_epochs=1, default_root_dir=str(out / f"lr_find_{spec}"))
    finder = Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=1e-1, num_training=6, early_stop_threshold=None)
    extra = {"lrs": list(finder.results["lr"]), "lr_losses": list(finder.results["loss"]), "lr": model.lr}
    model.losses.clear()
    trainer.fit(model)
    return model, trainer, extra


def case_lr_finder_callback(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    """``LearningRateFinder`` runs the search inside fit (on_fit_start), then restores and trains."""
    from lightning.pytorch.callbacks import LearningRateFinder

    model = Net()
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1e-1, num_training_steps=6, early_stop_threshold=None)
    trainer = _trainer(spec, max_epochs=1, default_root_dir=str(out / f"lr_cb_{spec}"), callbacks=[finder])
    trainer.fit(model)
    return model, trainer, {"lr": model.lr, "lr_losses": list(finder.optimal_lr.results["loss"])}


def case_scale_batch_size(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    model = Net(batch_size=2)
    trainer = _trainer(spec, max_epochs=1, default_root_dir=str(out / f"sbs_{spec}"))
    size = Tuner(trainer).scale_batch_size(model, mode="power", steps_per_trial=2, init_val=2, max_trials=2)
    extra = {"size": size}
    model.losses.clear()
    trainer.fit(model)
    return model, trainer, extra


def case_ckpt_best(spec: str, out: Path) -> tuple[Net, pl.Trainer, dict]:
    """EarlyStopping + ModelCheckpoint(save_top_k=2); validate/test the best after fit; resume from it."""
    root = out / f"ckpt_{spec}"
    model = Net(lr=5e-2)
    ckpt = ModelCheckpoint(dirpath=str(root), monitor="val_loss", save_top_k=2, filename="{epoch}")
    trainer = _trainer(spec, max_epochs=5, limit_val_batches=2, enable_checkpointing=True,
                       callbacks=[ckpt, EarlyStopping(monitor="val_loss", patience=1, min_delta=0.0)])
    trainer.fit(model)
    extra: dict[str, Any] = {"best": Path(ckpt.best_model_path).name, "stopped_epoch": trainer.current_epoch,
                             "val_fit": list(model.val_losses)}
    model.val_losses.clear()
    extra["validate"] = trainer.validate(model, ckpt_path="best", verbose=False)
    extra["test"] = trainer.test(model, ckpt_path="best", verbose=False)
    extra["val_best"] = list(model.val_losses)
    extra["test_best"] = list(model.test_losses)
    resumed = Net(lr=5e-2)
    t2 = _trainer(spec, max_epochs=extra["stopped_epoch"] + 2)
    t2.fit(resumed, ckpt_path=ckpt.best_model_path)
    extra["resumed_losses"] = list(resumed.losses)
    extra["resumed_weights"] = _weights(t2, resumed, spec)
    return model, trainer, extra


CASES: dict[str, Callable[[str, Path], tuple[Net, pl.Trainer, dict]]] = {
    "freeze_midway": case_freeze_midway,
    "freeze_then_unfreeze": case_freeze_then_unfreeze,
    "unfreeze_midway": case_unfreeze_midway,
    "ema": case_ema,
    "accumulation_scheduler": case_accumulation_scheduler,
    "pruning": case_pruning,
    "backbone_finetuning": case_backbone_finetuning,
    "swa": case_swa,
    "clip_norm_acc3": _clip_case("norm"),
    "clip_value_acc3": _clip_case("value"),
    "clip_value_partial": _clip_case("value"),  # zero2_partial: refused
    "noclip_acc3": _clip_case("none"),
    "torch_clip": case_torch_clip,
    "module_clip": case_module_clip,
    "manual_clip": _manual_case(torch_clip=False),
    "manual_torch_clip": _manual_case(torch_clip=True),
    "grad_edit": case_grad_edit,  # ddp only: clipping must change the run, or its parity proves nothing
    "lr_find": case_lr_find,
    "scale_batch_size": case_scale_batch_size,
    "lr_finder_callback": case_lr_finder_callback,
    "ckpt_best": case_ckpt_best,
}


def _barrier_or_exit() -> None:
    """After a failed run: continue only once every rank got here (tests/helpers/harness.py)."""
    barrier_or_exit("callbacks", 2 * TIMEOUT_S + 30)  # long enough for a rank blocked in a collective to time out first


def run(ctx: ScenarioContext, case: str, spec: str) -> None:
    pl.seed_everything(0, workers=True)
    error: Optional[str] = None
    weights: dict[str, Tensor] = {}
    model: Optional[Net] = None
    extra: dict[str, Any] = {}
    try:
        model, trainer, extra = CASES[case](spec, ctx.out)
        weights = _weights(trainer, model, spec)
    except Exception:  # noqa: BLE001 - recorded and read by the tests
        error = traceback.format_exc()
        print(f"[callbacks rank {dist.get_rank()}] {case}/{spec} failed:\n{error}", file=sys.stderr)
        _barrier_or_exit()
    mine = {"error": error, "losses": list(model.losses) if model is not None else [], "extra": extra,
            "weights": weights if spec == "ddp" else {}}  # ddp: each rank's own copy (do the replicas agree?)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        errors = [r["error"] for r in gathered]
        ctx.record(f"{case}.{spec}", {
            "error": None if not any(errors) else "\n".join(f"rank {i}: {e}" for i, e in enumerate(errors) if e),
            "per_rank": gathered, "weights": weights,
        })


@scenario("callbacks.train")
def train(ctx: ScenarioContext) -> None:
    if not dist.is_initialized():  # one process group for every run (Lightning reuses it)
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    for case, specs in ctx.params["runs"].items():
        for spec in specs:
            run(ctx, case, spec)
