"""Weights changed by the user's code between steps reach the masters at stages 0-2 (zero/flat_group.py
[Note: writes outside the optimizer]): through ``gathered_params(writeback=True)`` at once, and any
change before the next step or the next state dict. One process, bf16-mixed, so the masters (fp32, or
bf16 with 16-bit device states) are not the model's parameters. The two-rank parity with ddp is the
zoo's "clamped" model (also under offload); 16-bit states, which ddp has no counterpart of, and offload
keep the set value through the next step at ``lr=0`` (a Kahan word would otherwise add its old remainder
back; offload's masters must have taken it before the step)."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.offload.param_writes import ShardPrints
from lightning_zero.zero.partition import build_layout
from tests.helpers.parity_model import ParityNet


class EditAfterFirstStep(pl.Callback):
    """Sets one weight to 0.25 after the first step (WGAN-style, through ``.data``), then reads the state dict.
    ``assign``: ``w.data = new`` instead of writing in place (zero/rebind.py [Note: replaced parameter storage])."""

    def __init__(self, writeback: bool, assign: bool = False) -> None:
        self.writeback = writeback
        self.assign = assign
        self.state: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: ParityNet, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != 1:
            return
        block = pl_module.blocks[0]
        with trainer.strategy.gathered_params(block, writeback=True) if self.writeback else nullcontext():
            if self.assign:
                block.up.weight.data = torch.full_like(block.up.weight.data, 0.25)
            else:
                block.up.weight.data.fill_(0.25)
        self.state = trainer.strategy.full_state_dict()


def _fit(strategy: ZeroStrategy, callback: pl.Callback, max_steps: int = 1, lr: float = 3e-3) -> None:
    Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=max_steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, limit_val_batches=0,
            callbacks=[callback]).fit(ParityNet(checkpointing=False, lr=lr))


@pytest.mark.parametrize("writeback", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_weight_changed_between_steps_reaches_the_masters(stage: int, writeback: bool) -> None:
    cb = EditAfterFirstStep(writeback)
    _fit(ZeroStrategy(stage=stage), cb)
    weight = cb.state["blocks.0.up.weight"]
    assert weight.dtype == torch.float32 and torch.all(weight == 0.25)
    assert not torch.all(cb.state["blocks.1.up.weight"] == 0.25)  # only what was changed


class StateAfterSecondStep(EditAfterFirstStep):
    """The same edit after step 1; the state dict read after step 2."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: ParityNet, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 1:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif trainer.global_step == 2:
            self.state = trainer.strategy.full_state_dict()
            fg = trainer.strategy.engines[0].groups[0]
            lo, hi = fg.flat_param.data_ptr(), fg.flat_param.data_ptr() + fg.flat_param.nbytes
            self.views_after_second_step = all(lo <= p.data_ptr() < hi for p in fg.params)


@pytest.mark.parametrize("stage,mode", [(0, "plain"), (1, "plain"), (2, "plain"), (2, "cpu_in_backward")])
def test_a_weight_given_new_storage_is_stepped_from_and_stays_a_view(stage: int, mode: str) -> None:
    """``w.data = new`` gave the parameter storage of its own: the state dict and every later step ignored it
    (stages 1 and 2 trained 0.17 apart from ddp in 6 steps; the two-rank parity is the zoo's "renormed"). Now
    the value reaches the masters (the step at ``lr=0`` keeps it) and the parameter views the flat buffer
    again, so later steps reach it."""
    kwargs: dict[str, Any] = OFFLOAD["cpu_in_backward"] if mode != "plain" else {}
    now = EditAfterFirstStep(writeback=False, assign=True)
    _fit(ZeroStrategy(stage=stage, **kwargs), now)
    assert torch.all(now.state["blocks.0.up.weight"] == 0.25)
    later = StateAfterSecondStep(writeback=False, assign=True)
    strategy = ZeroStrategy(stage=stage, **kwargs)
    _fit(strategy, later, max_steps=2, lr=0.0)
    assert torch.all(later.state["blocks.0.up.weight"] == 0.25)
    assert later.views_after_second_step  # the step wrote the edited weight through its view


@pytest.mark.parametrize("writeback", [True, False])
@pytest.mark.parametrize("precision", ["bf16_sr", "bf16_kahan"])
@pytest.mark.parametrize("stage", [1, 2])
def test_16bit_states_take_a_weight_changed_between_steps(stage: int, precision: str, writeback: bool) -> None:
    """With 16-bit device states the masters are bf16 and the step writes them back over the parameters: an
    edit between steps is in the state dict at once, and after one more step at ``lr=0`` it is exact."""
    now = EditAfterFirstStep(writeback)
    _fit(ZeroStrategy(stage=stage, state_precision=precision), now)
    assert torch.all(now.state["blocks.0.up.weight"] == 0.25)
    later = StateAfterSecondStep(writeback)
    _fit(ZeroStrategy(stage=stage, state_precision=precision), later, max_steps=2, lr=0.0)
    assert torch.all(later.state["blocks.0.up.weight"] == 0.25)
    assert not torch.all(later.state["blocks.1.up.weight"] == 0.25)


OFFLOAD = {
    "cpu": dict(offload_optimizer="cpu"),
    "cpu_in_backward": dict(offload_optimizer="cpu", nonfinite="ignore"),  # the step during backward (eager.py)
    "partial": dict(offload_optimizer="cpu", offload_ratio=0.5, bucket_size_mb=0.002),  # the edited weight: device share
    "compact": dict(offload_optimizer="cpu", offload_state_precision="bf16_kahan"),  # compact_state.py
    "nvme": dict(offload_optimizer="nvme"),
}


@pytest.mark.parametrize("writeback", [True, False])
@pytest.mark.parametrize("stage,mode", [(1, "cpu"), (2, "cpu"), (2, "cpu_in_backward"), (2, "partial"), (2, "compact"),
                                        (2, "nvme")])
def test_offload_takes_a_weight_changed_between_steps(stage: int, mode: str, writeback: bool, tmp_path: Any) -> None:
    """Host-memory masters (offload/param_writes.py): the edit is in the state dict at once, and after one
    more step at ``lr=0`` (the step started from it, not from the master before it)."""
    kwargs: dict[str, Any] = dict(OFFLOAD[mode], stage=stage)
    if mode == "nvme":
        kwargs["nvme_path"] = str(tmp_path)
    now = EditAfterFirstStep(writeback)
    _fit(ZeroStrategy(**kwargs), now)
    assert torch.all(now.state["blocks.0.up.weight"] == 0.25)
    later = StateAfterSecondStep(writeback)
    strategy = ZeroStrategy(**kwargs)
    _fit(strategy, later, max_steps=2, lr=0.0)
    assert torch.all(later.state["blocks.0.up.weight"] == 0.25)
    assert not torch.all(later.state["blocks.1.up.weight"] == 0.25)
    if mode == "cpu_in_backward":
        assert strategy.engines[0].eager_steps == 2  # the path this case is for


@pytest.mark.parametrize("writeback", [True, False])
def test_delayed_update_refuses_a_weight_changed_between_steps(writeback: bool) -> None:
    """The delayed update's masters are a step ahead of the parameters: an edit is refused, not lost; during
    its synchronous warm-up it is taken as without the delay."""
    with pytest.raises(RuntimeError, match="delayed_param_update, whose masters are a step ahead"):
        _fit(ZeroStrategy(stage=2, offload_optimizer="cpu", delayed_param_update=True, delayed_param_update_warmup=0),
             EditAfterFirstStep(writeback))
    warm = EditAfterFirstStep(writeback)
    _fit(ZeroStrategy(stage=2, offload_optimizer="cpu", delayed_param_update=True, delayed_param_update_warmup=2), warm)
    assert torch.all(warm.state["blocks.0.up.weight"] == 0.25)


class EditBeforeOptimizerStep(pl.Callback):
    """Sets one weight after backward, before the optimizer step; reads the state dict after the step."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: ParityNet, optimizer: Any) -> None:
        pl_module.blocks[0].up.weight.data.fill_(0.25)

    def on_train_batch_end(self, trainer: Trainer, pl_module: ParityNet, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.state = trainer.strategy.full_state_dict()


def test_a_weight_changed_after_backward_under_offload() -> None:
    """The step after backward starts from the changed weight, as ddp's optimizer does (kept at ``lr=0``);
    the step during backward ran from the weight before it: refused, not lost (param_writes.py)."""
    after = EditBeforeOptimizerStep()
    _fit(ZeroStrategy(stage=2, **OFFLOAD["cpu"]), after, lr=0.0)
    assert torch.all(after.state["blocks.0.up.weight"] == 0.25)
    with pytest.raises(RuntimeError, match="changed after backward began"):
        _fit(ZeroStrategy(stage=2, **OFFLOAD["cpu_in_backward"]), EditBeforeOptimizerStep())


def _group(flat: torch.Tensor, layout: Any, shard: int) -> SimpleNamespace:
    """The pieces of a FlatParamGroup that ShardPrints reads, over ``flat``."""
    from lightning_zero.zero.flat_group import FlatParamGroup

    group = SimpleNamespace(flat_param=flat, layout=layout, shard=shard)
    group.param_chunk = lambda bi: FlatParamGroup.param_chunk(group, bi)  # type: ignore[arg-type]
    return group


def test_fingerprints_name_exactly_the_changed_chunks() -> None:
    """offload/param_writes.py: every one-element change (a sign, the lowest bit) shows in its own bucket's
    fingerprint and no other; an untouched buffer shows none (so nothing is copied to the host)."""
    layout = build_layout([40, 24], num_shards=2, bucket_numel=32)
    assert len(layout.buckets) > 1
    flat = torch.randn(layout.total).to(torch.bfloat16)
    prints = ShardPrints([_group(flat, layout, 1)])
    prints.record()
    assert prints.changed()[1] == []
    for bi, b in enumerate(layout.buckets):
        lo, hi = b.chunk_range(1)
        for i in range(lo, hi):
            for new in (-flat[i], (flat[i:i + 1].view(torch.int16) ^ 1).view(torch.bfloat16)[0]):
                old = flat[i].clone()
                flat[i] = new
                assert prints.changed()[1] == [(0, bi)]
                flat[i] = old
        flat[b.chunk_range(0)[0]] += 1  # the other rank's chunk: not this rank's to adopt
        assert prints.changed()[1] == []
    fp32 = torch.randn(layout.total)
    before = fp32.clone()
    ShardPrints([_group(fp32, layout, 0)]).take()
    assert torch.equal(fp32, before)  # fingerprinting reads the parameters only (an int32 view is them)
