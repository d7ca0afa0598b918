"""Sequence parallelism (issue #30): the ranks of a sequence-parallel group train one sequence, each holding
a slice of its tokens. ``layout`` says which tokens a rank holds, ``blockwise`` is attention over one block
of keys with its log-sum-exp (the piece both schemes merge), ``ulysses`` re-shards from sequence to heads
with two all-to-alls, ``ring`` passes key/value blocks around the group; ``attention`` and ``positions`` are
the hook for models that are not HF transformers (hook.py)."""

from lightning_zero.sequence.blockwise import attention_reference, block_attention
from lightning_zero.sequence.hook import attention, positions
from lightning_zero.sequence.layout import SequenceLayout
from lightning_zero.sequence.ring import ring_attention
from lightning_zero.sequence.ulysses import ulysses_attention

__all__ = ["attention", "positions", "SequenceLayout", "attention_reference", "block_attention", "ring_attention", "ulysses_attention"]
