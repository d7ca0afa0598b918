"""What attention needs to know about the sequence split, held by the model's attention modules.

[Note: the sequence context]
A ``SequenceContext`` is built once per sequence-parallel group and attached to each attention module of the
model (``attach``: an attribute on the module, no global registry), so the attention function, which HF
and our hook call with only the module and ``q, k, v``, finds the group, the layout and the scheme there.
The pieces that change per batch, the layout (the sequence length) and the document ids of packed
sequences, are set on it by the batch splitter (apply.py ``split_batch``) before each forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.sequence.layout import SequenceLayout
from lightning_zero.sequence.ring import ring_attention
from lightning_zero.sequence.ulysses import TokenOrder, token_order, ulysses_attention

ATTRIBUTE = "_lz_sequence"
"""The attribute of an attention module that holds its ``SequenceContext``."""

SCHEMES = ("auto", "ulysses", "ring")


@dataclass
class SequenceContext:
    """The sequence-parallel group of this rank, how a sequence is split over it, and which scheme attends."""

    group: Optional[C.ProcessGroup]
    layout: SequenceLayout
    scheme: str = "auto"
    """``ulysses`` (heads must divide by the group size), ``ring``, or ``auto``: Ulysses where heads divide."""
    doc: Optional[Tensor] = field(default=None, repr=False)
    """``[B, S_local]`` document ids of the current packed batch (batch.py), None for one document per row."""
    calls: int = 0
    """Attention calls through this context since the strategy last reset it (apply.py's first-step check)."""
    orders: dict[tuple[SequenceLayout, str], TokenOrder] = field(default_factory=dict, repr=False)
    """Ulysses' token order per (layout, device), made once (ulysses.py [Note: no host round trip per call])."""

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"sequence-parallel attention must be one of {SCHEMES}, got {self.scheme!r}")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None) -> Tensor:
        """``[B, H, S_local, D]`` attention over the group's whole sequence."""
        self.calls += 1
        n = C.world_size(self.group)
        ring = self.scheme == "ring" or (self.scheme == "auto" and q.shape[1] % n != 0)
        if ring:
            return ring_attention(q, k, v, self.layout, self.group, doc=self.doc, causal=causal, scale=scale)
        key = (self.layout, str(q.device))
        if key not in self.orders:
            if len(self.orders) >= 8:  # sequence lengths that vary batch to batch: keep the cache small
                self.orders.clear()
            self.orders[key] = token_order(self.layout, q.device)
        return ulysses_attention(q, k, v, self.layout, self.group, doc=self.doc, causal=causal, scale=scale,
                                 order=self.orders[key])


    def positions(self) -> Tensor:
        """Global positions of this rank's tokens (host tensor)."""
        return self.layout.positions(C.rank(self.group))


def attach(modules: list[nn.Module], context: SequenceContext) -> None:
    """Give each attention module the context its attention function reads."""
    for module in modules:
        setattr(module, ATTRIBUTE, context)


def context_of(module: nn.Module) -> SequenceContext:
    """The context ``attach`` gave ``module``; a clear error when attention runs on a module nobody split."""
    context = getattr(module, ATTRIBUTE, None)
    if context is None:
        raise RuntimeError(
            f"{type(module).__name__} runs sequence-parallel attention but has no sequence context: "
            "it was not prepared by lightning_zero.sequence (attach)"
        )
    return context
