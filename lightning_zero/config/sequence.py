"""Sequence parallelism (issue #30): how many ranks train one sequence, how attention crosses the split,
and the long-sequence memory options (lightning_zero/sequence/)."""

from __future__ import annotations

from dataclasses import dataclass

VALID_SEQUENCE_ATTENTION = ("auto", "ulysses", "ring")
VALID_SEQUENCE_LAYOUTS = ("zigzag", "contiguous")


@dataclass
class SequenceConfig:
    """The sequence-parallel degree and scheme, and the tiled MLP / chunked loss switches."""

    sequence_parallel: int = 1
    """Ranks that train one sequence together, each holding 1/N of its tokens (contiguous data-parallel
    ranks). They see the same samples (the sampler shards by ``data-parallel degree / N``), and ZeRO
    partitions over all data-parallel ranks, these included, so adding sequence parallelism costs no
    model-state memory. Batches must be dicts with ``input_ids`` (and optionally ``labels``,
    ``position_ids``): the strategy splits them (lightning_zero/sequence/batch.py)."""

    sequence_attention: str = "auto"
    """``ulysses`` (two all-to-alls; heads must divide by ``sequence_parallel``), ``ring`` (key/value blocks
    passed around the group), or ``auto``: Ulysses where the heads divide, ring elsewhere."""

    sequence_layout: str = "zigzag"
    """Which tokens a rank holds: ``zigzag`` balances causal attention work (2N chunks, rank r holds r and
    2N-1-r), ``contiguous`` keeps slices in order (lightning_zero/sequence/layout.py)."""

    tiled_mlp: int = 1
    """Run each block's ``mlp`` over this many sequence tiles, each recomputed in the backward (1: off;
    lightning_zero/sequence/tiled_mlp.py)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.sequence_parallel, bool) or not (isinstance(self.sequence_parallel, int)
                                                            and self.sequence_parallel >= 1):
            raise ValueError(f"sequence_parallel must be an integer >= 1, got {self.sequence_parallel!r}.")
        if self.sequence_attention not in VALID_SEQUENCE_ATTENTION:
            raise ValueError(f"sequence_attention must be one of {VALID_SEQUENCE_ATTENTION}, got "
                             f"{self.sequence_attention!r}.")
        if self.sequence_layout not in VALID_SEQUENCE_LAYOUTS:
            raise ValueError(f"sequence_layout must be one of {VALID_SEQUENCE_LAYOUTS}, got {self.sequence_layout!r}.")
        if isinstance(self.tiled_mlp, bool) or not (isinstance(self.tiled_mlp, int) and self.tiled_mlp >= 1):
            raise ValueError(f"tiled_mlp must be an integer >= 1 (tiles; 1 = off), got {self.tiled_mlp!r}.")
