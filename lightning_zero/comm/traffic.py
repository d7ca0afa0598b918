"""Bytes a rank sends, counted where the collectives are issued, so a step's traffic can be read and compared.

[Note: counting bytes sent]
A ring all-gather or reduce-scatter over ``n`` ranks makes each rank send ``n - 1`` chunks; an equal-split
all-to-all sends ``n - 1`` chunks too (its own stays home). So every collective is counted the same way:
``(n - 1) x`` the chunk this rank contributes, in bytes on the wire (codes and scales for the quantized ones,
comm/quantized.py). These are the bytes an algorithm must move, not what a particular backend does (NCCL's
tree or gloo's pairwise exchanges move the same amount to within a constant); a comparison of two runs in
one process (zero3 against ZeRO++'s qwZ/qgZ, tests/quant) is therefore fair. One :class:`Traffic` per engine,
labelled by what the bytes carried and over which ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ring_bytes(chunk_numel: int, element_size: int, n: int) -> int:
    """Bytes one rank sends in an exact all-gather / reduce-scatter of ``chunk_numel`` elements per rank."""
    return (n - 1) * chunk_numel * element_size if n > 1 else 0


@dataclass
class Traffic:
    """Bytes sent by this rank, by label (``param_gather``, ``grad_reduce``, ...; see the engine using it)."""

    sent: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, nbytes: int) -> None:
        if nbytes:
            self.sent[label] = self.sent.get(label, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters (subtract two snapshots for one step's traffic)."""
        return dict(self.sent)
