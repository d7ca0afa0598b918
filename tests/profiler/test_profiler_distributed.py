"""FlopsProfiler on 2 gloo ranks (issue #19): under zero3 every module's parameter count is the
un-partitioned model's while the storage is released, and Linear FLOPs are exact; under 2 pipeline
stages each stage reports its own layers and the stages add up to the model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPTModule  # noqa: E402

from lightning_zero.profiler import ModuleProfiler  # noqa: E402
from tests.profiler.dist_runs import dist_results  # noqa: E402
from tests.profiler.dist_checks import TINY  # noqa: E402


def test_zero3_parameter_counts_equal_the_unpartitioned_model() -> None:
    plain = GPTModule(TINY)
    expected = {name: sum(p.numel() for p in m.parameters()) for name, m in plain.named_modules()}
    linears = {name: m for name, m in plain.named_modules() if isinstance(m, nn.Linear)}
    for rank, rec in enumerate(dist_results()["prof_zero3"]):
        assert rec["storage_released"]  # the counts do not come from gathered storage
        assert rec["params"] == expected
        assert rec["model_params"] == expected[""]
        for name, lin in linears.items():  # batch 4 x seq 8 per rank
            assert rec["fwd"][name] == 2 * lin.in_features * lin.out_features * 32, name
        assert rec["bwd_flops"] > rec["fwd"][""]
    reports = [rec["report_path"] for rec in dist_results()["prof_zero3"]]
    assert reports[1] is None and reports[0] is not None and os.path.isfile(reports[0])  # written once
    assert "params:" in Path(reports[0]).read_text()


def test_pipeline_stages_report_their_own_layers_and_add_up() -> None:
    stage0, stage1 = dist_results()["prof_pipe"]
    plain = GPTModule(TINY)
    full = sum(p.numel() for p in plain.parameters())
    tied = plain.model.wte.weight.numel() + plain.model.wpe.weight.numel()  # the embedding lives on both ends
    assert stage0["stage_params"] + stage1["stage_params"] == full + tied == stage0["model_params"]
    assert 0 < stage0["stage_params"] < full and 0 < stage1["stage_params"] < full
    with ModuleProfiler(plain.model) as prof:  # the plain GPT's forward on the same batch shape
        plain.model(torch.zeros(4, 8, dtype=torch.long))
    assert stage0["stage_fwd"] > 0 and stage1["stage_fwd"] > 0
    assert stage0["stage_fwd"] + stage1["stage_fwd"] == stage0["model_fwd"] == prof.result.fwd_flops
    assert stage0["report_path"].endswith("flops_profile_stage0.txt") and os.path.isfile(stage0["report_path"])
    assert stage1["report_path"].endswith("flops_profile_stage1.txt") and os.path.isfile(stage1["report_path"])
