"""Ready tensor-parallel plans (torch's ``ParallelStyle``s, applied by ``parallelize_module``).

A plan maps module names to ``ColwiseParallel`` (output features split over tp: each rank computes a
slice of the heads or of the MLP's hidden units) or ``RowwiseParallel`` (input features split; the
partial outputs are summed over tp, so what follows sees replicated activations), Megatron's pairing:
one all-reduce per attention and one per MLP in forward, one each in backward. Embeddings, norms and
the LM head stay replicated (plain parameters): their gradients are equal on every tp rank, which the
ZeRO engines rely on (parallel/dtensor.py [Note: ZeRO sees the local TP shard]).

[Note: attention heads under TP]
A column split of q/k/v must cut between heads, never inside one: the head counts must be divisible by
tp. Each rank then runs ``heads / tp`` heads. transformers 5.x's LlamaAttention infers the head count
from the projection's width (``view(*shape, -1, head_dim)``) and keeps ``num_key_value_groups``, a
ratio tp does not change, so it needs no edit; older code keeps ``num_heads``/``num_key_value_heads``
attributes, which :func:`parallelize` sets to the local values (as torchtitan and Lightning's TP
examples do).
"""

from __future__ import annotations

from typing import Any, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_zero.parallel.stage import stage_plan
from lightning_zero.parallel.validate import check_plan

HEAD_ATTRS = ("num_heads", "num_key_value_heads")
"""Attention-module attributes holding head counts that :func:`parallelize` makes local."""


def _tp_size(tp: Union[int, DeviceMesh]) -> int:
    return tp.size() if isinstance(tp, DeviceMesh) else int(tp)


def _decoder_layers(model: nn.Module) -> tuple[str, Any]:
    """(name prefix, ModuleList) of a Llama-style model's decoder layers (``LlamaForCausalLM.model.layers``
    or ``LlamaModel.layers``)."""
    for prefix in ("model.layers", "layers"):
        owner: Any = model
        for atom in prefix.split("."):
            owner = getattr(owner, atom, None)
        if isinstance(owner, nn.ModuleList):
            return prefix, owner
    raise ValueError(
        f"tp_plan_llama: {type(model).__name__} has no decoder layers at .model.layers or .layers "
        "(an HF Llama-style model, e.g. LlamaForCausalLM, is expected)."
    )


def _check_heads(what: str, counts: dict[str, int], tp: int) -> None:
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ValueError(
            f"{what}: {bad} not divisible by tensor_parallel={tp}: a column split of the projections would cut "
            "through a head. Pick a tensor_parallel degree that divides the head counts."
        )


def tp_plan_llama(model: nn.Module, tp: Union[int, DeviceMesh]) -> dict[str, ParallelStyle]:
    """Plan for HF Llama-style decoders (Llama, Mistral, Qwen2 share the names): ``q/k/v_proj`` and the
    MLP's ``gate/up_proj`` column-wise, ``o_proj`` and ``down_proj`` row-wise. ``tp``: the tp mesh
    (``self.device_mesh["tp"]``) or its size; head counts must divide by it ([Note: attention heads
    under TP])."""
    size = _tp_size(tp)
    prefix, layers = _decoder_layers(model)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        _check_heads(type(model).__name__, {
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        }, size)
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(layers)):
        base = f"{prefix}.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{base}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{base}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"{base}.mlp.{name}"] = ColwiseParallel()
        plan[f"{base}.mlp.down_proj"] = RowwiseParallel()
    check_plan(model, plan)
    return plan


def tp_plan_gpt(model: nn.Module, tp: Union[int, DeviceMesh]) -> dict[str, ParallelStyle]:
    """Plan for the example GPT (examples/gpt.py): each block's MLP, ``mlp.fc`` column-wise and
    ``mlp.proj`` row-wise. The attention stays replicated: its fused ``qkv`` projection lays its output
    out as ``[q | k | v]``, so a contiguous column split would hand rank 0 all of q and part of k; it
    needs a per-head interleaved layout first (left for later). ``tp`` must divide the MLP width. The
    pipeline form (``gpt_pipeline``, a stage's layers) gets the same split of the blocks it holds
    (stage.py [Note: TP plans per pipeline stage])."""
    size = _tp_size(tp)
    blocks = getattr(model, "blocks", None)
    if blocks is None and "layers" in dict(model.named_children()):  # gpt_pipeline: this stage's blocks
        plan = stage_plan(model, {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        for name in plan:
            linear = model.get_submodule(name)
            if name.endswith("mlp.fc") and linear.out_features % size:
                raise ValueError(f"tp_plan_gpt: MLP width {linear.out_features} not divisible by tensor_parallel={size}.")
        return plan
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"tp_plan_gpt: {type(model).__name__} has no .blocks ModuleList (examples/gpt.py's GPT expected).")
    plan: dict[str, ParallelStyle] = {}
    for i, block in enumerate(blocks):
        if block.mlp.fc.out_features % size:
            raise ValueError(f"tp_plan_gpt: MLP width {block.mlp.fc.out_features} not divisible by tensor_parallel={size}.")
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
    check_plan(model, plan)
    return plan


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """``parallelize_module(model, tp_mesh, plan)`` after checking that every plan key names a module,
    with attention modules' head-count attributes made local ([Note: attention heads under TP])."""
    check_plan(model, plan)
    size = tp_mesh.size()
    parallelize_module(model, tp_mesh, plan)
    for module in model.modules():
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and hasattr(module, "q_proj"):
                _check_heads(type(module).__name__, {attr: value}, size)
                setattr(module, attr, value // size)
    return model
