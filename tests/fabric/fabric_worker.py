"""Scenario ``fabric.runs`` (tests/helpers/harness.py): a hand-written Fabric loop (or a Trainer resuming a Fabric checkpoint).

Runs ``{NAME: SPEC}`` (``run_worker``);
SPEC is ``KIND[:key=value,...]`` with KIND ``ddp``, a registered name (``zero1``, ``zero3_offload``...)
or ``trainer-zeroK`` (a Trainer with ZeroStrategy(stage=K) that fits from ``load``). Keys: steps,
accum (micro-batches per step, accumulated under ``fabric.no_backward_sync``), clip (max_norm), clip_value,
first (index of the first step: data and step counter), save (save a checkpoint after that step
into OUT/NAME_ckpt), load (a checkpoint directory to resume from before ``first``), raw (a consolidated
file for ``fabric.load_raw``), meta=1 (stage 3:
``fabric.init_module(empty_init=True)``), precision, inject (rank 1 makes its loss infinite at that
step), clamp (after each step the blocks' weights are clamped to that bound through ``p.data``, WGAN's
weight clipping; ``gathered=1`` does it inside ``fabric.strategy.gathered_params(module, writeback=True)``),
refused=1 (the run must stop with an error: its text is the result, ``{"error": ...}``). Rank 0 writes OUT/NAME.pt: per-step global losses (mean over ranks of each micro-batch), the
clip norms, full weights at the end, and what the run observed about its parameters.

Data: every step takes one global batch of GLOBAL samples per micro-batch; rank r of W takes rows
r::W of it, so any world size that divides GLOBAL sees the same global batches (resume on 3 ranks
of a run saved on 2 continues the same trajectory).
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.parity_runs import parse  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.parity_model import DIM, VOCAB, Block, RandomTokens  # noqa: E402
from tests.helpers.worker_io import save_atomic  # noqa: E402

GLOBAL = 12
"""Samples per micro-batch over all ranks (divisible by 2 and 3)."""
DATA = RandomTokens(4096)


class FabricNet(pl.LightningModule):
    """ParityNet's awkward shapes without its Trainer-only parts: a tied head read outside its module
    (``F.linear`` on the embedding), a frozen layer, a block called twice, a buffer, sizes dividing
    by neither 2 nor 3, two param groups. A LightningModule, so the Trainer resumes the same class."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM))
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + 0.1 * self.frozen(h)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[1](h)
        h = self.norm(h) * self.gain
        return F.linear(h, self.emb.weight)

    def param_groups(self) -> list[dict[str, Any]]:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    # the Trainer's side (trainer-zeroK runs)
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_of(self(x), y)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.param_groups(), lr=self.lr)


class Shard(Dataset):
    """Rank ``rank`` of ``world``'s rows of the global micro-batches ``first`` .. ``first + n``."""

    def __init__(self, first: int, n: int, rank: int, world: int) -> None:
        self.rows = [m * GLOBAL + j for m in range(first, first + n) for j in range(rank, GLOBAL, world)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return DATA[self.rows[i]]


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def make_fabric(kind: str, opts: dict[str, str]) -> Fabric:
    world = int(os.environ["WORLD_SIZE"])
    precision = opts.get("precision", "32-true")
    if kind == "ddp":
        strategy: Any = DDPStrategy(find_unused_parameters=False)
    elif precision == "16-mixed":  # Fabric maps 16-mixed on CPU to bf16: hand the plugin in directly
        stage = int(kind[4])
        strategy = lightning_zero.ZeroFabricStrategy(
            stage=stage, precision=lightning_zero.ZeroFabricPrecision("16-mixed", {"hysteresis": 1, "initial_scale_power": 8}),
            bucket_size_mb=0.002)
        precision = None
    else:
        strategy = lightning_zero.ZeroFabricStrategy(**lightning_zero.PRESETS[kind], bucket_size_mb=0.002,
                                                     **({"param_persistence_threshold": 0} if "zero3" in kind else {}))
    kwargs = {"precision": precision} if precision else {}
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def fabric_run(name: str, kind: str, opts: dict[str, str], out: str) -> dict[str, Any]:
    fabric = make_fabric(kind, opts)
    fabric.seed_everything(0)
    meta = opts.get("meta") == "1"
    with fabric.init_module(empty_init=meta):
        model = FabricNet()
    on_meta = all(p.is_meta for p in model.parameters())
    opt = torch.optim.AdamW(model.param_groups(), lr=model.lr)
    model, opt = fabric.setup(model, opt)
    steps, accum, first = int(opts.get("steps", 6)), int(opts.get("accum", 2)), int(opts.get("first", 0))
    clip = float(opts.get("clip", 0.5))
    if "raw" in opts:  # a consolidated checkpoint file: weights only
        fabric.load_raw(opts["raw"], model)
    weights0 = fabric.strategy.full_state_dict() if kind != "ddp" else None
    if "load" in opts:
        state = {"model": model, "optimizer": opt, "step": -1}
        fabric.load(opts["load"], state)
        assert state["step"] == first - 1, state["step"]
    loader = DataLoader(Shard(first * accum, steps * accum, fabric.global_rank, fabric.world_size),
                        batch_size=GLOBAL // fabric.world_size)
    batches = iter(loader)
    losses, norms, skipped = [], [], []
    for step in range(first, first + steps):
        for micro in range(accum):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                loss = loss_of(model(x), y)
                if step == int(opts.get("inject", -1)) and fabric.global_rank == 1:
                    loss = loss * float("inf")
                fabric.backward(loss / accum)
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        if clip:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=clip)))
        if "clip_value" in opts:  # elementwise, instead of (clip=0) or before nothing else
            fabric.clip_gradients(model, opt, clip_val=float(opts["clip_value"]))
        opt.step()
        opt.zero_grad()
        if "clamp" in opts:
            bound = float(opts["clamp"])
            gathered = getattr(fabric.strategy, "gathered_params", None) if opts.get("gathered") == "1" else None
            with gathered(model, writeback=True) if gathered is not None else nullcontext():
                for p in model.module.blocks.parameters():
                    p.data.clamp_(-bound, bound)
        skipped.append(getattr(fabric.strategy, "skipped_steps", 0))
        if step == int(opts.get("save", -1)):
            fabric.save(os.path.join(out, f"{name}_ckpt"), {"model": model, "optimizer": opt, "step": step})
    module = model.module
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        weights = fabric.strategy.full_state_dict()
    dtypes = sorted({str(p.dtype) for p in module.parameters()})
    return {"losses": losses, "norms": norms, "weights": weights, "weights0": weights0, "on_meta": on_meta, "dtypes": dtypes,
            "skipped": skipped, "loss_scale": getattr(fabric.strategy, "loss_scale", None),
            "broadcast": fabric.broadcast(fabric.global_rank * 10 + 7, src=1),
            "ckpt": os.path.join(out, f"{name}_ckpt")}


def trainer_run(kind: str, opts: dict[str, str]) -> dict[str, Any]:
    """A Trainer on ZeroStrategy resuming the Fabric checkpoint ``load``, for ``steps`` steps."""
    pl.seed_everything(0)
    model = FabricNet()
    steps, accum, first = int(opts.get("steps", 2)), int(opts.get("accum", 2)), int(opts.get("first", 0))
    strategy = lightning_zero.ZeroStrategy(stage=int(kind[-1]), bucket_size_mb=0.002)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=steps,
        accumulate_grad_batches=accum, gradient_clip_val=float(opts.get("clip", 0.5)) or None, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    loader = DataLoader(Shard(first * accum, steps * accum, rank, world), batch_size=GLOBAL // world)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=opts["load"])
    return {"losses": list(model.losses), "weights": strategy.full_state_dict()}


@scenario("fabric.runs")
def runs(ctx: ScenarioContext) -> None:
    out = str(ctx.out)
    for name, spec in ctx.params["runs"].items():
        kind, opts = parse(spec)
        for key in ("load", "raw"):
            if key in opts and not os.path.isabs(opts[key]):
                opts[key] = os.path.join(out, opts[key])
        try:
            result = trainer_run(kind[len("trainer-"):], opts) if kind.startswith("trainer-") else fabric_run(name, kind, opts, out)
        except Exception as error:  # noqa: BLE001 (a refused run: every rank stops at the same point)
            if opts.get("refused") != "1":
                raise
            result = {"error": f"{type(error).__name__}: {error}"}
        if int(os.environ["RANK"]) == 0:
            save_atomic(result, os.path.join(out, f"{name}.pt"))
        torch.distributed.barrier()

