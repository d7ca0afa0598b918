"""benchmarks/moe.py's dropped fraction (issue #32 item 3): the mean over the MoE layers of the assignments
their capacity dropped, in the JSON record and the table row; checked on CPU against a count made here from
each layer's demand and capacity, without the benchmark's Trainer.

Its routing health ([Note: routing health] in benchmarks/moe.py): the collapse test and warning on the
2026-11-29 EP 4 figures (84% dropped), the text windows, and one ``--smoke`` launch on 2 gloo ranks (~12 s on
a 2-core box) that trains on the example's corpus and must keep every rank's dropped fraction below the
collapse threshold, with the new fields in its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.moe import (
    BalancedGate,
    TABLE_HEADER, collapse_dropped, collapse_warning, layers_dropped_fraction, routing_collapsed, table_row,
    text_windows,
)
from lightning_zero.moe import MoE
from tests.helpers.launch import ROOT, user_env
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


def _health(init: float, warmup_end: float, timed: float, max_dropped: float = collapse_dropped(8) / 2) -> dict:
    return dict(dropped_fraction_init=init, dropped_fraction_warmup_end=warmup_end, dropped_fraction=timed,
                max_dropped=max_dropped, collapse_dropped=collapse_dropped(8))


def test_collapse_threshold_flags_the_2026_11_29_rows() -> None:
    """84% dropped at EP 4 (RESULTS.md, 2026-11-29) is the collapse value 1 - 1.25/8; the default threshold is
    half of it. A collapse at the end of warm-up alone, or in the timed mean alone, is a collapse."""
    assert collapse_dropped(8) == pytest.approx(0.84375)
    assert collapse_dropped(2) == pytest.approx(0.375)
    limit = collapse_dropped(8) / 2
    assert routing_collapsed(_health(0.23, 0.84, 0.839), limit)
    assert routing_collapsed(_health(0.23, 0.10, 0.50), limit)  # collapsed during the timed steps
    assert routing_collapsed(_health(0.23, 0.60, 0.30), limit)  # collapsed by the end of warm-up
    assert not routing_collapsed(_health(0.23, 0.30, 0.29), limit)


def test_a_collapsed_record_is_marked_in_the_row_and_warned() -> None:
    base = dict(config="moe", dispatch="sorted", world=2, ep=2, experts=8, tokens_per_s=1.0, step_s=1.0,
                all_to_all_share=0.1, peak_memory_gib=1.0)
    healthy = {**base, **_health(0.01, 0.05, 0.29), "routing_collapsed": False}
    collapsed = {**base, **_health(0.23, 0.84, 0.839), "routing_collapsed": True}
    assert collapse_warning([healthy, healthy]) is None
    assert "collapsed" not in table_row(healthy, [healthy, healthy])
    assert table_row(collapsed, [healthy, collapsed]).count("**routing collapsed**") == 1
    warning = collapse_warning([healthy, collapsed])
    assert warning is not None and warning.startswith("WARNING: routing collapsed")
    assert "rank 1 23.0% / 84.0% / 83.9%" in warning and "rank 0" not in warning


def test_text_windows_hold_the_run_in_one_epoch() -> None:
    """GPT-1.3B's shape at 4 GPUs (8 x 4 x 16 windows of 1024) does not fit the corpus side by side: the windows
    overlap, and there are enough of them; the smoke shape's do not overlap. Byte tokens of English text."""
    big = text_windows(8 * 4 * 16, 1024)
    assert len(big) >= 512 and big.stride < 1024
    small = text_windows(2 * 2 * 5, 64)
    assert small.stride == 64
    x, y = small[3]
    assert x.shape == y.shape == (64,) and torch.equal(x[1:], y[:-1]) and int(x.max()) < 256
    text = bytes(big.tokens[:200_000].tolist())
    assert text.count(b" the ") > 500


def _smoke(*flags: str) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "benchmarks/moe.py", "--smoke", "--config", "moe", "--ep", "2", *flags]
    env = user_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0]), proc.stdout


def test_smoke_run_on_text_keeps_its_routing() -> None:
    """The default data is the corpus, and on it the smoke run's routing stays healthy on both ranks: every
    rank's timed mean and last warm-up step below the threshold (half the collapse value, 0.42). Seen: first
    step 0.8% / 5.5%, timed 28.6% / 31.5% (rank 0 / 1) with torch 2.13 on CPU. Not a loose bound: the same
    run made longer (--steps 20 --warmup 5) ends above it (42.5% timed on rank 0): the warning fires."""
    record, stdout = _smoke()
    assert record["data"] == "text"
    steps = record["dropped_fraction_steps"]
    assert len(steps) == 4  # --smoke: 1 warm-up + 3 timed steps, each step's dropped fraction from the first
    assert record["dropped_fraction_init"] == pytest.approx(steps[0], abs=1e-4)
    assert record["dropped_fraction_warmup_end"] == pytest.approx(steps[0], abs=1e-4)  # warm-up is one step
    assert record["dropped_fraction"] == pytest.approx(sum(steps[1:]) / 3, abs=1e-4)
    assert record["collapse_dropped"] == pytest.approx(1 - 1.25 / 8)
    assert record["max_dropped"] == pytest.approx(record["collapse_dropped"] / 2)
    assert record["routing_collapsed"] is False
    for key in ("dropped_fraction", "dropped_fraction_init", "dropped_fraction_warmup_end"):
        per_rank = record[f"per_rank_{key}"]
        assert len(per_rank) == 2 and all(0.0 <= d < record["max_dropped"] for d in per_rank), (key, per_rank)
    assert "WARNING" not in stdout
    assert "| moe (sorted) | 2 | 2 | 8 |" in stdout


def test_balanced_routing_sends_token_i_to_expert_i_mod_e_with_the_gates_work_still_done() -> None:
    """benchmarks/moe.py [Note: balanced routing]: the same gate (its parameters, its matmul and their backward)
    with the choice fixed, so a benchmark times the layer at a balanced load even when the learned router has
    collapsed. The bias saturates the softmax, so the gate's weight gets a zero gradient: computed, not learned."""
    torch.manual_seed(0)
    layer = MoE(16, lambda: MLP(16, 32), num_experts=4, top_k=1, capacity_factor=1.25, min_capacity=1)
    weight = layer.gate.weight
    with torch.no_grad():
        weight.zero_()
        weight[2] += 1.0  # a collapsed router: every token prefers expert 2
    x = torch.randn(12, 16).abs()
    assert layer.gate(x).experts[:, 0].tolist() == [2] * 12  # the learned choice, collapsed
    layer.gate.__class__ = BalancedGate
    assert layer.gate.weight is weight
    routing = layer.gate(x)
    assert routing.experts[:, 0].tolist() == [i % 4 for i in range(12)]
    assert float(routing.dropped_fraction) == 0.0
    layer(x).sum().backward()
    assert weight.grad is not None  # the gate's backward ran
    assert all(bool(e.fc.weight.grad.abs().sum() > 0) for e in layer.experts)  # every expert did work
