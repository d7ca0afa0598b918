"""Fabric with ``mixed_precision='autocast'`` (lightning_zero/precision.py [Note: two mixed-precision layouts]):
the module runs under autocast over fp32 weights and returns fp32, as Fabric's own ``bf16-mixed`` does; one
training step gives Fabric's single-device weights (single process)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_zero


class Recorder(nn.Module):
    """A Linear that records whether autocast was on when it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.autocast_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return self.norm(self.lin(x))


def _one_step(strategy: object) -> tuple[Recorder, torch.Tensor, dict[str, torch.Tensor]]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()  # a parallel strategy reseeds from PL_GLOBAL_SEED here when an earlier test set it
    torch.manual_seed(0)
    model = Recorder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped, opt = fabric.setup(model, opt)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = wrapped(x)
    fabric.backward(out.float().pow(2).mean())
    opt.step()
    weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return model, out, weights


@pytest.mark.parametrize("stage", [1, 2])
def test_fabric_autocast_layout_matches_fabric_bf16_mixed(stage: int) -> None:
    ref_model, ref_out, ref_w = _one_step("auto")
    model, out, weights = _one_step(lightning_zero.ZeroFabricStrategy(stage=stage, mixed_precision="autocast"))
    assert model.autocast_seen == ref_model.autocast_seen == [True]
    assert out.dtype == ref_out.dtype == torch.float32
    assert torch.equal(out.detach(), ref_out.detach())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for k in ref_w:
        assert torch.allclose(weights[k], ref_w[k], rtol=1e-6, atol=1e-7), k
