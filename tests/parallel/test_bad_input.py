"""Tensor-parallel bad input fails before training with one clear error (no processes needed)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZeroConfig
from lightning_zero.parallel import check_plan, check_tensor_parallel, tp_plan_gpt, tp_plan_llama
from lightning_zero.parallel_dims import ParallelDims


def _llama(heads: int = 4, kv: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=8 * heads, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8)
    return LlamaForCausalLM(cfg)


def test_sizes_that_do_not_divide_the_world() -> None:
    with pytest.raises(ValueError, match="not divisible by pipeline_stages=1 x tensor_parallel=3"):
        ParallelDims(world_size=4, global_rank=0, tp=3)
    with pytest.raises(ValueError, match="tensor_parallel must be an integer >= 1"):
        ZeroConfig(tensor_parallel=0)


def test_rank_layout_is_pipeline_major_tp_innermost() -> None:
    dims = [ParallelDims(world_size=8, global_rank=r, pp=2, tp=2) for r in range(8)]
    assert [(d.pp_rank, d.dp_rank, d.tp_rank) for d in dims[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert dims[0].dp_ranks(0, 1) == [1, 3] and dims[0].pp_ranks(1, 0) == [2, 6]


def test_pipeline_x_tp_needs_stage_0_or_1() -> None:
    ZeroStrategy(stage=1, tensor_parallel=2, pipeline_stages=2)
    with pytest.raises(ValueError, match="ZeRO stage 2 cannot be combined with pipeline_stages=2"):
        ZeroStrategy(stage=2, tensor_parallel=2, pipeline_stages=2)


def test_compile_with_tensor_parallel_is_refused_up_front() -> None:
    """On 4 gloo ranks (pp 2 x tp 2 and pp 1 x tp 2, ZeRO-1) the compiled blocks failed inside dynamo
    ("set the storage of a tensor on device cpu to a storage on different device meta"): refused before training."""
    ZeroConfig(compile=True, stage=1, pipeline_stages=2)  # compile under the pipeline is built
    with pytest.raises(ValueError, match="compile with tensor_parallel=2 is not built yet"):
        ZeroConfig(compile=True, tensor_parallel=2)
    with pytest.raises(ValueError, match="compile with tensor_parallel=2 is not built yet"):
        ZeroStrategy(stage=1, compile=True, tensor_parallel=2, pipeline_stages=2)


def test_stage_plan_refuses_a_layer_holding_part_of_the_plan() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_zero.parallel import stage_plan
    from tests.parallel.pp_tp_model import LAYER_PLAN, PPTPNet

    pipe = PPTPNet(blocks=2).pipe
    plan = stage_plan(pipe, LAYER_PLAN)
    assert sorted({k.split(".")[1] for k in plan}) == ["1", "2"] and len(plan) == 14  # the blocks, not embed/norm
    with pytest.raises(ValueError, match=r"layers.1 \(Block\) has \['attn.q_proj'\] but not \['attn.nope'\]"):
        stage_plan(pipe, {"attn.q_proj": ColwiseParallel(), "attn.nope": RowwiseParallel()})


def test_gpt_plan_for_the_pipeline_form_covers_the_stage_blocks() -> None:
    """examples/gpt_module.py's configure_model applies tp_plan_gpt to either form; the pipeline form's plan
    names the blocks' MLPs of the layers the stage holds (here all of them: not placed)."""
    from examples.gpt import GPTConfig, gpt_pipeline

    from lightning_zero.parallel import tp_plan_gpt

    pipe = gpt_pipeline(GPTConfig(vocab_size=16, n_layer=2, n_head=2, d_model=8, seq_len=4))
    plan = tp_plan_gpt(pipe, 2)
    assert sorted(plan) == ["layers.1.mlp.fc", "layers.1.mlp.proj", "layers.2.mlp.fc", "layers.2.mlp.proj"]
    with pytest.raises(ValueError, match="MLP width 32 not divisible by tensor_parallel=3"):
        tp_plan_gpt(pipe, 3)


def test_plan_naming_missing_modules() -> None:
    model = _llama()
    with pytest.raises(ValueError, match=r"do not exist.*model\.layers\.7\.self_attn\.q_proj"):
        check_plan(model, {"model.layers.7.self_attn.q_proj": ColwiseParallel()})
    check_plan(model, {"model.layers.*.self_attn.q_proj": ColwiseParallel()})  # wildcards as parallelize_module


def test_heads_not_divisible_by_tp() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads.*not divisible by tensor_parallel=2"):
        tp_plan_llama(_llama(heads=4, kv=1), 2)
    with pytest.raises(ValueError, match="num_attention_heads.*not divisible by tensor_parallel=3"):
        tp_plan_llama(_llama(heads=4, kv=4), 3)
    assert len(tp_plan_llama(_llama(), 2)) == 7


def test_gpt_plan_names_exist_and_model_without_blocks_is_refused() -> None:
    from examples.gpt import GPT, GPTConfig

    plan = tp_plan_gpt(GPT(GPTConfig(vocab_size=16, n_layer=2, n_head=2, d_model=8, seq_len=8)), 2)
    assert sorted(plan) == ["blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"]
    with pytest.raises(ValueError, match="no decoder layers"):
        tp_plan_llama(torch.nn.Linear(2, 2), 2)


def test_unparallelized_model_under_tensor_parallel() -> None:
    with pytest.raises(ValueError, match="tensor_parallel=2 but the module has no tensor-parallel"):
        check_tensor_parallel(torch.nn.Linear(2, 2), 2)
