"""A weight renormalised by *assigning* ``.data``, as cosine classifiers and prototype heads are written.

:class:`RenormedHead` ("renormed"): NormFace / SwAV-style prototypes, re-normalised to unit rows before every
step with ``w.data = F.normalize(w.data, dim=1)`` in ``on_train_batch_start`` (the assignment, not an in-place
write: the parameter gets new storage). ddp keeps the new tensor and steps it. Stages 0-2 trained silently
apart (0.17 in 6 steps: the parameter kept the user's tensor while the step updated the flat buffer) until
they put such a parameter back into the buffer (zero/rebind.py [Note: replaced parameter storage]); stage 3
refuses it (REFUSED in test_zoo.py), and :class:`RenormedGatheredHead` ("renormed_gathered") does the same
inside ``trainer.strategy.gathered_params(head, writeback=True)``, which stage 3 follows.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.zoo.layouts import VOCAB, TokenLM


class RenormedHead(TokenLM):
    """An embedding, two residual blocks and a cosine head whose rows are renormalised before every step."""

    SCALE = 8.0
    """Cosine logits times this (NormFace's scale)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.head = nn.Linear(d, VOCAB, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(3.0)  # far from unit rows: the first renormalisation changes every value

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(F.normalize(x, dim=-1)) * self.SCALE

    def renorm_context(self) -> ContextManager[Any]:
        """Where the renormalisation runs: as users write it (here: nowhere special)."""
        return nullcontext()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        with self.renorm_context():
            w = self.head.weight
            w.data = F.normalize(w.data, dim=1)


class RenormedGatheredHead(RenormedHead):
    """The same renormalisation inside ``gathered_params(head, writeback=True)`` (ddp has none: plain there)."""

    def renorm_context(self) -> ContextManager[Any]:
        gathered = getattr(self.trainer.strategy, "gathered_params", None)
        return gathered(self.head, writeback=True) if gathered is not None else nullcontext()
