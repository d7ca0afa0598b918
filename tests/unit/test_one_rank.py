"""One data-parallel rank: the shortcuts of stage2.py's [Note: one data-parallel rank] train bit for bit
like the general path (gradients staged, scattered and added; stage 3's units gathered by copy).

The oracle is the same strategy with ``single_rank_shortcuts`` off, on a model with what the shortcuts
must get right: a parameter unused in every other step (its slot is zeroed, never copied), a tied
weight and a module called twice (several gradients into one slot), frozen weights (stage 3's frozen
group is aliased too), activation checkpointing (a unit's forward again inside backward), gradient
accumulation (later micro-batches add into the fp32 shard) and clipping (the norm reads the shard).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.zero.stage2 import Stage2Engine
from tests.helpers.parity_model import ParityNet


def _fit(stage: int, precision: str) -> tuple[list[float], dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    model = ParityNet()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5,
        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=ZeroStrategy(stage=stage, param_persistence_threshold=0),
    )
    trainer.fit(model)
    return model.losses, trainer.strategy.full_state_dict(), trainer.strategy.engines[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_shortcuts_train_like_the_general_path(stage: int, precision: str, monkeypatch) -> None:
    losses, weights, engine = _fit(stage, precision)
    assert all(engine._direct), "the shortcut was not taken: this test would compare the general path with itself"
    if stage == 3:
        assert all(fg.aliased for fg in engine.all_groups) and engine.frozen_groups
    monkeypatch.setattr(Stage2Engine, "single_rank_shortcuts", False)
    ref_losses, ref_weights, ref_engine = _fit(stage, precision)
    assert not any(ref_engine._direct)
    assert len(losses) == len(ref_losses) == 8
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, ref_weights[name]), name


@pytest.mark.parametrize("name", ["nanogpt", "llama_lora", "t5", "gan"])
def test_one_rank_shortcuts_on_models_we_did_not_write(name: str, monkeypatch) -> None:
    """nanoGPT, HF Llama + peft LoRA (a frozen base: stage 3's frozen group aliased too), HF T5 (embeddings
    tied three ways) and Lightning's two-optimizer GAN (two engines, toggled ``requires_grad``, manual
    optimization) under zero3, bf16-mixed, with gradient accumulation but for the GAN: the shortcuts train bit for bit like the general path."""
    from tests.offload.helpers import fit
    from tests.zoo.models import build

    def run() -> tuple[object, object]:
        torch.manual_seed(0)
        steps = 6 if name == "gan" else 3  # the GAN: two optimizer steps per batch
        return fit(steps=steps, model=build(name), stage=3, precision="bf16-mixed",
                   accumulate=1 if name == "gan" else 2, clip=None if name == "gan" else 0.5)  # the GAN: manual

    t_fast, fast = run()
    assert all(all(e._direct) and all(fg.aliased for fg in e.all_groups) for e in t_fast.strategy.engines)
    monkeypatch.setattr(Stage2Engine, "single_rank_shortcuts", False)
    t_ref, ref = run()
    assert not any(any(e._direct) for e in t_ref.strategy.engines)
    for key in ("g_losses", "d_losses") if name == "gan" else ("losses",):
        got, want = getattr(fast, key), getattr(ref, key)
        assert len(got) >= 3 and got == want, (key, got, want)
    got, want = t_fast.strategy.full_state_dict(), t_ref.strategy.full_state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
