"""A causal-LM batch split over the sequence-parallel group, and the loss that stays the global token mean.

[Note: splitting a causal-LM batch]
Three things must be done on the whole sequence, before it is split: the labels are shifted (the target
of the last token of rank r's slice is the first token of the next slice, which rank r never sees), the
position ids are taken (HF would number each slice from 0), and, for packed sequences, the document ids
are derived from the position ids (a new document wherever they restart at 0). Each rank then keeps its
tokens of the input ids, the shifted labels, the position ids and the document ids (layout.py). The
loss each rank returns is ``n * sum(local token losses) / (valid tokens of the whole sequence)``: the mean
over the ``n`` ranks, which is what data-parallel gradient averaging takes, is the global token mean,
whatever number of ignored labels (``-100``) each slice holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.sequence.layout import SequenceLayout

IGNORE_INDEX = -100


@dataclass
class SequenceShard:
    """One rank's part of a batch: ``[B, S_local]`` each."""

    input_ids: Tensor
    shift_labels: Tensor
    """The labels already shifted by one over the whole sequence (HF's ``shift_labels``)."""
    position_ids: Tensor
    doc: Optional[Tensor]
    """Document ids for packed sequences, None when every row is one document."""
    targets: Tensor
    """The target tokens (shifted labels not ``-100``) of the whole batch, every rank's slices together: the
    denominator of the global token mean, counted once here (0-dim int64)."""


def documents(position_ids: Tensor) -> Optional[Tensor]:
    """``[B, S]`` document ids from position ids that restart at 0 per document; None for one document."""
    starts = position_ids == 0
    starts[:, 0] = True
    if int(starts.sum()) == position_ids.shape[0]:
        return None
    return starts.to(torch.int64).cumsum(1) - 1


def shard_batch(input_ids: Tensor, labels: Optional[Tensor], layout: SequenceLayout, rank: int,
                position_ids: Optional[Tensor] = None) -> SequenceShard:
    """This rank's part of a causal-LM batch (see [Note: splitting a causal-LM batch]); ``labels`` default
    to the input ids."""
    labels = input_ids if labels is None else labels
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    doc = documents(position_ids)  # the labels are shifted as HF's loss shifts them, across documents too:
    # collators that pack (DataCollatorWithFlattening) put -100 on each document's first label for that
    return SequenceShard(
        input_ids=layout.shard(input_ids, rank), shift_labels=layout.shard(shifted, rank),
        position_ids=layout.shard(position_ids, rank), doc=layout.shard(doc, rank) if doc is not None else None,
        targets=(shifted != IGNORE_INDEX).sum(),
    )


def sequence_loss(logits: Tensor, shift_labels: Tensor, group: Optional[C.ProcessGroup]) -> Tensor:
    """This rank's share of the global token-mean cross-entropy, scaled so that the mean over the group is
    the global mean (see [Note: splitting a causal-LM batch]); computed in fp32."""
    flat = shift_labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    count = (flat != IGNORE_INDEX).sum().to(torch.float32)
    C.all_reduce(count, group)
    return total * C.world_size(group) / count.clamp_min(1.0)
