"""optim/step_hooks.py [Note: step hooks and steps torch never takes]: where the engine's own kernel replaces
``optimizer.step()`` (16-bit device states, offload's compiled CPU Adam), optimizer step hooks would silently never
run; they are refused at setup, through the real front door, while fp32 states (which call ``optimizer.step()``)
still run them."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_zero


def _setup(options: dict, hook: bool, precision: str = "bf16-mixed") -> int:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision,
                    strategy=lightning_zero.ZeroFabricStrategy(**options))
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = []
    if hook:
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append(1))
    model, opt = fabric.setup(model, opt)
    loss = model(torch.randn(4, 8)).square().mean()
    fabric.backward(loss)
    opt.step()
    return len(calls)


@pytest.mark.parametrize("options", [dict(stage=2, state_precision="bf16_sr"),
                                     dict(stage=2, offload_optimizer="cpu")], ids=["bf16_sr", "offload"])
def test_step_hooks_are_refused_where_optimizer_step_never_runs(options: dict) -> None:
    with pytest.raises(ValueError, match=r"not optimizer.step\(\), so the 1 optimizer step hook\(s\) registered on "
                                         r"AdamW .* would never run"):
        _setup(options, hook=True)


def test_without_hooks_they_set_up_and_fp32_states_run_the_hooks() -> None:
    assert _setup(dict(stage=2, state_precision="bf16_sr"), hook=False) == 0
    assert _setup(dict(stage=2), hook=True, precision="32-true") == 1
