"""benchmarks/moe.py's dropped fraction (issue #32 item 3): the mean over the MoE layers of the assignments
their capacity dropped, in the JSON record and the table row; checked on CPU against a count made here from
each layer's demand and capacity, without the benchmark's Trainer (a launch would cost a minute of CI)."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.moe import TABLE_HEADER, layers_dropped_fraction, table_row
from lightning_zero.moe import MoE
from tests.moe.reference import MLP

H = 8


def _layer(factor: float) -> MoE:
    return MoE(H, lambda: MLP(H), num_experts=4, top_k=1, capacity_factor=factor, min_capacity=1)


def test_dropped_fraction_is_the_mean_over_moe_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_layer(0.5), nn.Linear(H, H), _layer(1.0))
    assert layers_dropped_fraction(model) is None  # no forward yet
    model(torch.randn(40, H))
    expected = []
    for layer in (model[0], model[2]):
        stats = layer.last_stats
        over = (stats.expert_counts - stats.capacity).clamp(min=0).sum().item()
        expected.append(over / 40)
    assert expected[0] > 0  # half the balanced load: something is dropped
    got = layers_dropped_fraction(model)
    assert abs(float(got) - sum(expected) / 2) < 1e-7
    assert layers_dropped_fraction(nn.Linear(H, H)) is None


def test_table_row_carries_the_dropped_fraction() -> None:
    records = [dict(config="moe", dispatch="capacity", world=2, ep=2, experts=8, tokens_per_s=91381.4, step_s=0.179,
                    all_to_all_share=0.108, dropped_fraction=frac, peak_memory_gib=42.8) for frac in (0.0312, 0.05)]
    row = table_row(records[0], records)
    assert row == ("| moe (capacity) | 2 | 2 | 8 | 91,381 | 0.1790 | 10.8% (10.8%, 10.8%) | 3.12% (3.12%, 5.00%) "
                   "| 42.8 (42.8, 42.8) |")
    assert row.count("|") == TABLE_HEADER.splitlines()[0].count("|")
    assert table_row({**records[0], "config": "dense", "dispatch": None}, records).startswith("| dense | 2 |")
