"""The strategy's batch split under sequence parallelism (lightning_zero/sequence/apply.py), on one process:
what each rank receives, and the batches it refuses before any work."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.config import SequenceConfig
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.sequence.apply import split_batch
from lightning_zero.sequence.batch import shard_batch
from lightning_zero.sequence.context import SequenceContext
from lightning_zero.sequence.layout import SequenceLayout


def _split(batch, rank: int = 0, layout: str = "contiguous"):
    dims = ParallelDims(world_size=2, global_rank=rank, sp=2)
    context = SequenceContext(None, SequenceLayout(4, 2, layout))
    return split_batch(batch, context, dims, SequenceConfig(sequence_parallel=2, sequence_layout=layout)), context


def test_each_rank_gets_its_tokens_shifted_labels_and_positions() -> None:
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, 3] = -100
    for rank in (0, 1):
        out, context = _split({"input_ids": ids, "labels": labels}, rank)
        lo, hi = 4 * rank, 4 * rank + 4
        assert torch.equal(out["input_ids"], ids[:, lo:hi])
        assert torch.equal(out["position_ids"], torch.arange(lo, hi).expand(2, 4))
        shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
        assert torch.equal(out["shift_labels"], shifted[:, lo:hi]) and torch.equal(out["labels"], out["shift_labels"])
        # HF divides the summed loss by this: 13 real targets of the whole batch over 2 ranks
        assert float(out["num_items_in_batch"]) == pytest.approx(13 / 2)
        assert context.layout.seq_len == 8 and context.doc is None


def test_the_shard_carries_the_target_count_of_the_whole_batch() -> None:
    """Counted once, on the whole batch, by the split itself (every rank the same figure)."""
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, 3] = -100  # a target (position >= 1): not counted
    labels[1, 0] = -100  # the first label is never a target after the shift: changes nothing
    layout = SequenceLayout(8, 2, "zigzag")
    assert [int(shard_batch(ids, labels, layout, r).targets) for r in (0, 1)] == [13, 13]
    assert int(shard_batch(ids, None, layout, 0).targets) == 14


def test_packed_rows_give_document_ids() -> None:
    ids = torch.arange(8).view(1, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    out, context = _split({"input_ids": ids, "position_ids": pos}, rank=1)
    assert torch.equal(out["position_ids"], pos[:, 4:])
    assert context.doc.tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize("batch,match", [
    (torch.zeros(2, 8, dtype=torch.long), "splits dict batches with 'input_ids'"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "pixel_values": torch.zeros(2)}, "pixel_values"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])},
     "does not take padded batches"),
    ({"input_ids": torch.zeros(2, 6, dtype=torch.long)}, "pad it to a multiple of 4"),
])
def test_refused_batches(batch, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _split(batch, layout="zigzag")


def test_all_ones_attention_mask_is_dropped() -> None:
    ids = torch.arange(16).view(2, 8)
    out, _ = _split({"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long)})
    assert "attention_mask" not in out
