"""What the strategy does for sequence parallelism: prepare the model once, split each batch.

[Note: sequence parallelism in the strategy]
At setup (before the engines exist, so nothing is gathered or cast yet), ``prepare_module`` finds the HF
models inside the LightningModule and switches their attention to the sequence-parallel function
(hf.py), tiles their MLPs if asked (tiled_mlp.py), and returns the ``SequenceContext`` they share; a
LightningModule with no HF model inside gets the context on every module instead, for the attention hook
(hook.py). Each batch then passes ``split_batch`` in the strategy's ``batch_to_device``, on the host,
before it moves: the checks (an all-ones mask), the document ids and the count read the whole batch, which
on the host costs no device synchronisation, and only this rank's slice is copied to the device
(``on_before_batch_transfer`` has seen the whole batch; ``transfer_batch_to_device`` and
``on_after_batch_transfer`` receive the slice). A dict with
``input_ids`` (and optionally ``labels``, ``position_ids``, an all-ones ``attention_mask``) becomes this
rank's slice with ``position_ids``, ``shift_labels`` (so HF's loss does not shift again), ``labels`` (HF
computes a loss only when labels are given; with ``shift_labels`` present they are not read) and
``num_items_in_batch`` (the global count of target tokens, counted once by ``shard_batch``, over the
group's size, so HF's summed loss divided by it is this rank's share of the global token mean; batch.py
[Note: splitting a causal-LM batch]). The user's ``self.model(**batch).loss`` is then unchanged. The
document ids of packed rows go to the context, and to the device beside the slice (``move_documents``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.config import SequenceConfig
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.sequence.batch import shard_batch
from lightning_zero.sequence.context import SequenceContext, attach
from lightning_zero.sequence.hf import prepare_hf
from lightning_zero.sequence.layout import SequenceLayout
from lightning_zero.sequence.tiled_mlp import tile_mlps

BATCH_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def hf_models(module: nn.Module) -> list[nn.Module]:
    """The HF ``PreTrainedModel``s inside ``module`` (outermost only)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional
        return []
    found: list[nn.Module] = []
    for m in module.modules():
        if isinstance(m, PreTrainedModel) and not any(m in f.modules() for f in found):
            found.append(m)
    return found


def prepare_module(module: nn.Module, config: SequenceConfig, dims: ParallelDims) -> SequenceContext:
    """Switch the HF models in ``module`` to sequence-parallel attention, or, without any, give every
    module the context the attention hook reads (hook.py [Note: the attention hook]); see [Note: sequence
    parallelism in the strategy]. The shared context's layout is fixed at the first batch."""
    context = SequenceContext(dims.sp_group, SequenceLayout(2 * dims.sp, dims.sp, config.sequence_layout),
                              config.sequence_attention)
    models = hf_models(module)
    for model in models:
        prepare_hf(model, context)
    if not models:
        attach(list(module.modules()), context)
    tile_module_mlps(module, config)
    return context


def tile_module_mlps(module: nn.Module, config: SequenceConfig) -> None:
    """``tiled_mlp`` > 1: tile every ``mlp`` of ``module`` (with or without sequence parallelism: it is a memory
    switch of its own, and a switch that silently did nothing would be a lie); none found is refused."""
    if config.tiled_mlp > 1 and tile_mlps(module, config.tiled_mlp) == 0:
        raise ValueError(f"tiled_mlp={config.tiled_mlp}: {type(module).__name__} has no submodule named 'mlp'")


def check_attention_ran(context: SequenceContext, module: nn.Module) -> None:
    """After the first training step: refuse a model whose attention did not go through the group (it would
    have attended within each rank's slice only), before its backward and step."""
    if context.calls == 0:
        raise ValueError(
            f"sequence_parallel={C.world_size(context.group)}: no attention of {type(module).__name__} ran across "
            "the sequence split. Use an HF transformers model, or call lightning_zero.sequence.attention(self, q, "
            "k, v) in place of F.scaled_dot_product_attention (lightning_zero/sequence/hook.py)"
        )


def split_batch(batch: Any, context: SequenceContext, dims: ParallelDims, config: SequenceConfig) -> dict[str, Any]:
    """This rank's slice of a causal-LM batch (see [Note: sequence parallelism in the strategy])."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(f"sequence_parallel={dims.sp} splits dict batches with 'input_ids' (and optionally "
                         f"'labels', 'position_ids'); got {type(batch).__name__}")
    unknown = set(batch) - set(BATCH_KEYS)
    if unknown:
        raise ValueError(f"sequence_parallel={dims.sp}: batch keys {sorted(unknown)} cannot be split over the "
                         f"sequence (known: {list(BATCH_KEYS)})")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(f"sequence_parallel={dims.sp} does not take padded batches (attention_mask with zeros): "
                         "pack the sequences with position_ids restarting at 0 per document instead")
    ids: Tensor = batch["input_ids"]
    layout = SequenceLayout(ids.shape[1], dims.sp, config.sequence_layout)
    shard = shard_batch(ids, batch.get("labels"), layout, dims.sp_rank, position_ids=batch.get("position_ids"))
    context.layout, context.doc = layout, shard.doc
    return {"input_ids": shard.input_ids, "position_ids": shard.position_ids, "labels": shard.shift_labels,
            "shift_labels": shard.shift_labels, "num_items_in_batch": shard.targets.to(torch.float32) / dims.sp}


def move_documents(context: SequenceContext, device: torch.device) -> None:
    """Move the document ids ``split_batch`` left on the context to ``device``, beside the batch it moved."""
    if context.doc is not None:
        context.doc = context.doc.to(device)
