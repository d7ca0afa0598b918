"""Bad input under Fabric fails before any work, with a message that names the fix (single process)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

import lightning_zero
from lightning_zero.registry import PRESETS
from tests.fabric.fabric_worker import FabricNet


def _fabric(strategy: object) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    return fabric


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in ("pipeline", "zero3_offload_nvme")])
def test_every_registered_name_builds_a_fabric_strategy(name: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
    assert isinstance(fabric.strategy, lightning_zero.ZeroFabricStrategy)
    assert fabric.strategy.config.stage == PRESETS[name]["stage"]


def test_nvme_preset_without_a_path_is_refused_with_the_fix() -> None:
    """zero3_offload_nvme has no default nvme_path (issue #27): it must be given."""
    with pytest.raises(ValueError, match="needs nvme_path.*nvme_path='/mnt/nvme'"):
        Fabric(accelerator="cpu", devices=2, strategy="zero3_offload_nvme")


def test_pipeline_is_refused_with_a_reason() -> None:
    with pytest.raises(NotImplementedError, match="runs through the Trainer only"):
        Fabric(accelerator="cpu", devices=2, strategy="pipeline")


def test_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"Unknown ZeroStrategy option\(s\) \['bukcet_size_mb'\].*bucket_size_mb"):
        lightning_zero.ZeroFabricStrategy(stage=2, bukcet_size_mb=5)


def test_stage3_model_without_its_optimizer_fails_at_the_first_forward() -> None:
    fabric = _fabric("zero3")
    with fabric.init_module(empty_init=True):
        model = FabricNet()
    model = fabric.setup_module(model)
    with pytest.raises(RuntimeError, match="set up without one.*fabric.setup_optimizers"):
        model(torch.zeros(2, 3, dtype=torch.long))


def test_other_norms_and_mixed_clipping_are_refused() -> None:
    fabric = _fabric("zero2")
    model = FabricNet()
    opt = torch.optim.AdamW(model.param_groups(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    fabric.backward(model(torch.zeros(2, 3, dtype=torch.long)).float().pow(2).mean())
    with pytest.raises(ValueError, match="2-norm only"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type="inf")
    assert float(fabric.clip_gradients(model, opt, max_norm=1.0)) > 0  # the supported form works
    with pytest.raises(ValueError, match="by value after clipping by norm in the same step"):
        fabric.clip_gradients(model, opt, clip_val=1.0)
    opt.step()


def test_a_second_model_is_refused() -> None:
    fabric = _fabric("zero1")
    first = FabricNet()
    fabric.setup(first, torch.optim.AdamW(first.param_groups(), lr=1e-3))
    with pytest.raises(ValueError, match="sets up one model"):
        fabric.setup_module(FabricNet())


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_torch_clip_in_the_loop_is_refused_and_the_step_still_runs(stage: str) -> None:
    """zero/grad_window.py [Note: gradients in the hooks before the step]: between fabric.backward and
    optimizer.step each .grad is a placeholder (a torch clip there would silently clip nothing)."""
    from lightning_zero.zero.grad_window import GradientOutsideStepError

    fabric = _fabric(stage)
    model = FabricNet()
    opt = torch.optim.AdamW(model.param_groups(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    before = {k: v.clone() for k, v in fabric.strategy.full_state_dict().items()}
    fabric.backward(model(torch.zeros(2, 3, dtype=torch.long)).float().pow(2).mean())
    with pytest.raises(GradientOutsideStepError, match="was used .*fabric.clip_gradients"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # the placeholders are gone before the engine steps
    opt.zero_grad()
    after = fabric.strategy.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(not type(p.grad).__name__ == "PartitionedGrad" for p in model.parameters())
    # Fabric calls no teardown: end stage 3's first-batch watch (and its eager compile stance) here, or the
    # compile tests later in this process would run eagerly
    fabric.strategy.teardown()
