"""Scenario ``distributed.skipped_units`` (registered in scenarios.py): data-dependent control flow under Lightning's ddp
(find_unused_parameters=True) and the ZeRO stages. Writes ``OUT/<run>.pt`` on rank 0 with rank 0's
per-step losses.

- ``skip<B>_<kind>``: block B skipped on rank 1 only, on odd steps (issue #14: zero3's gathers);
- ``odd<wd>_<kind>``: a block and a side layer skipped on every rank on odd steps, and another block on
  rank 1 only at step 2, AdamW with weight decay ``wd`` (issue #27 item 8: parameters no rank used
  are not stepped); ZeRO runs also record whether the skipped layers' masters and optimizer states
  stayed bit for bit unchanged across each odd step;
- ``acc_<kind>``: the same model with two micro-batches per step, the block used in one of them."""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402


class SkipNet(pl.LightningModule):
    """Four blocks in a ModuleList (zero3's units); block ``skip`` is left out on rank 1 on odd steps."""

    def __init__(self, skip: int, first: bool = False) -> None:
        super().__init__()
        self.skip = skip
        self.parity = 0 if first else 1
        """Steps of this parity skip: 1 from the second step on; 0 in the first step already."""
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == self.skip and self.global_rank == 1 and self.trainer.global_step % 2 == self.parity:
                continue
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.trainer.global_step * 10 + self.global_rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        loss = ((self(x) - y) ** 2).mean()
        self.losses.append(float(loss))
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(64, 1), batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class OddSkipNet(pl.LightningModule):
    """Block 1 and ``side`` unused by every rank on odd steps (odd micro-batches with ``accumulate``), block 2
    unused on rank 1 at step 2; records the unused layers' ZeRO masters and states around odd steps."""

    def __init__(self, wd: float, accumulate: bool = False) -> None:
        super().__init__()
        self.wd, self.accumulate = wd, accumulate
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.side = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.losses: list[float] = []
        self.unchanged: list[bool] = []
        self._before: list[torch.Tensor] = []
        self._tick = 0

    def _odd(self) -> bool:
        return (self._tick if self.accumulate else self.trainer.global_step) % 2 == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        odd, step = self._odd(), self.trainer.global_step
        for i, block in enumerate(self.blocks):
            if (i == 1 and odd) or (i == 2 and self.global_rank == 1 and step % 4 == 2):
                continue
            x = torch.tanh(block(x))
        if not odd:
            x = x + 0.5 * torch.tanh(self.side(x))
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self._tick * 10 + self.global_rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        loss = ((self(x) - y) ** 2).mean()
        self._tick += 1
        self.losses.append(float(loss))
        return loss

    def _skipped_state(self) -> list[torch.Tensor]:
        """This rank's pieces of the skipped layers' masters and per-element optimizer states (ZeRO only)."""
        engine = getattr(self.trainer.strategy, "_engine_of", lambda o: None)(self.trainer.optimizers[0])
        if engine is None:
            return []
        skipped = {id(p) for m in (self.blocks[1], self.side) for p in m.parameters()}
        out = []
        for fg in engine.groups:
            st = engine.optimizer.state.get(fg.master, {})
            flat = [fg.master] + [v for v in st.values() if torch.is_tensor(v) and v.shape == fg.master.shape]
            shard = fg.shard if fg.layout.num_shards > 1 else 0
            for index, _, lo, n in fg.layout.param_pieces_in_shard(shard):
                if id(fg.params[index]) in skipped:
                    out += [t[lo : lo + n].clone() for t in flat]
        return out

    def on_train_batch_start(self, *args: object) -> None:  # before backward: offload may step during it
        self._before = self._skipped_state() if self.trainer.global_step % 2 == 1 and not self.accumulate else []

    def on_train_batch_end(self, *args: object) -> None:
        if self._before:
            after = self._skipped_state()
            self.unchanged.append(len(after) == len(self._before) and all(torch.equal(a, b) for a, b in
                                                                          zip(after, self._before)))
            self._before = []

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(64, 1), batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=self.wd)


ODD_KINDS = {  # name -> ZeroStrategy arguments
    "zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3, param_persistence_threshold=0),
    # nonfinite="ignore" keeps the CPU step during backward (the default "skip" steps after backward:
    # config/strategy.py), so this run checks the masked step where it is hardest: bucket by bucket
    "zero3_offload": dict(stage=3, param_persistence_threshold=0, offload_optimizer="cpu", nonfinite="ignore"),
    "zero3_offload_skip": dict(stage=3, param_persistence_threshold=0, offload_optimizer="cpu"),
}


def fit(model: pl.LightningModule, strategy: object, steps: int, accumulate: int = 1) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, accumulate_grad_batches=accumulate)
    trainer.fit(model)
    return trainer


def odd_runs(out: str) -> None:
    """Issue #27 item 8: see the module docstring."""
    for wd in (0.1, 0.0):
        for kind in ("ddp", *ODD_KINDS):
            pl.seed_everything(0)
            model = OddSkipNet(wd)
            strategy = (DDPStrategy(find_unused_parameters=True) if kind == "ddp" else
                        lightning_zero.ZeroStrategy(timeout_s=60, **ODD_KINDS[kind]))
            trainer = fit(model, strategy, 6)
            if trainer.global_rank == 0:
                eager = getattr(trainer.strategy.engines[0], "eager_steps", None) if kind != "ddp" else None
                torch.save({"losses": model.losses, "unchanged": model.unchanged, "eager_steps": eager},
                           os.path.join(out, f"odd{wd}_{kind}.pt"))
    for kind in ("ddp", "zero1", "zero2"):  # accumulation: a block used in one micro-batch of the step is used
        pl.seed_everything(0)  # (zero1 reduces only the last micro-batch, zero2 every one)
        model = OddSkipNet(0.1, accumulate=True)
        strategy = (DDPStrategy(find_unused_parameters=True) if kind == "ddp" else
                    lightning_zero.ZeroStrategy(stage=int(kind[-1])))
        if fit(model, strategy, 4, accumulate=2).global_rank == 0:
            torch.save({"losses": model.losses, "unchanged": model.unchanged}, os.path.join(out, f"acc_{kind}.pt"))


def run(out: str) -> None:
    odd_runs(out)
    for skip in (0, 2, 3):  # the first unit, one in the middle, the last one
        for kind in ("ddp", "zero3"):
            pl.seed_everything(0)
            model = SkipNet(skip)
            strategy = (DDPStrategy(find_unused_parameters=True) if kind == "ddp" else
                        lightning_zero.ZeroStrategy(stage=3, timeout_s=60, param_persistence_threshold=0,
                                                    bucket_size_mb=0.0005))
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 use_distributed_sampler=False)
            trainer.fit(model)
            if trainer.global_rank == 0:
                torch.save({"losses": model.losses}, os.path.join(out, f"skip{skip}_{kind}.pt"))
    first_step_runs(out)


def first_step_runs(out: str) -> None:
    """A unit skipped on rank 1 in the first step already: every rank raises the same error, naming the modules
    (stage 3 has no recorded order yet: first_step.py [Note: units skipped in the first step]); last in the
    launch, since the failed fit ends the ranks' process group."""
    for skip in (2, 3):  # in the middle (the next forward gather differs), the last one (backward's does)
        model = SkipNet(skip, first=True)
        strategy = lightning_zero.ZeroStrategy(stage=3, timeout_s=60, param_persistence_threshold=0,
                                               bucket_size_mb=0.0005)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False)
        try:
            trainer.fit(model)
            error = ""
        except RuntimeError as e:
            error = str(e)
        torch.save({"error": error, "losses": model.losses},
                   os.path.join(out, f"first{skip}_rank{trainer.global_rank}.pt"))

