"""Which tokens of a sequence each rank of a sequence-parallel group holds.

[Note: load-balanced causal layout]
With a causal mask, the query at position ``i`` attends to ``i + 1`` keys, so a contiguous split gives the
last rank of ``N`` about ``2N - 1`` times the attention work of the first. The ``zigzag`` layout cuts the
sequence into ``2N`` equal chunks and gives rank ``r`` chunks ``r`` and ``2N - 1 - r``: every rank then
holds one early and one late chunk and does the same work (torch's context parallel and Megatron's
context parallelism balance the same way). Attention never assumes the tokens it holds are contiguous:
masks are built from the global positions that travel with every block (blockwise.py), so one code path
serves both layouts and packed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SequenceLayout:
    """The split of a ``seq_len``-token sequence over ``size`` ranks (``kind``: contiguous or zigzag)."""

    seq_len: int
    size: int
    kind: str = "zigzag"

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"sequence layout must be one of {LAYOUTS}, got {self.kind!r}")
        parts = 2 * self.size if self.kind == "zigzag" else self.size
        if self.size < 1 or self.seq_len % parts:
            raise ValueError(
                f"a sequence of {self.seq_len} tokens cannot be split into {parts} equal parts for sequence "
                f"parallel {self.size} ({self.kind} layout): pad it to a multiple of {parts}"
            )

    @property
    def local_len(self) -> int:
        """Tokens each rank holds."""
        return self.seq_len // self.size

    def positions(self, rank: int) -> Tensor:
        """Global positions (int64, ascending) of the tokens ``rank`` holds."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a sequence-parallel group of {self.size}")
        if self.kind == "contiguous":
            return torch.arange(rank * self.local_len, (rank + 1) * self.local_len)
        chunk = self.seq_len // (2 * self.size)
        first = torch.arange(rank * chunk, (rank + 1) * chunk)
        last = 2 * self.size - 1 - rank
        return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk)])

    def shard(self, x: Tensor, rank: int, dim: int = 1) -> Tensor:
        """This rank's tokens of ``x`` (the full sequence along ``dim``)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} tokens along dim {dim}, got {x.shape[dim]}")
        return x.index_select(dim, self.positions(rank).to(x.device))

    def unshard(self, parts: list[Tensor], dim: int = 1) -> Tensor:
        """The full sequence from every rank's part (rank order), inverse of :meth:`shard`."""
        if len(parts) != self.size:
            raise ValueError(f"expected {self.size} parts, got {len(parts)}")
        order = torch.cat([self.positions(r) for r in range(self.size)]).to(parts[0].device)
        out = torch.empty_like(torch.cat(parts, dim))
        return out.index_copy_(dim, order, torch.cat(parts, dim))
