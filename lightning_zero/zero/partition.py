"""Pure partition math for flat parameter buffers (no tensors, no process groups: unit-testable).

[Note: bucket-major partitioning]
A param group's parameters are laid out back to back in one flat buffer, in *reverse* order of the
group (gradients arrive roughly in reverse during backward, so buckets fill front to back). The
buffer is cut into buckets of at most ``bucket_numel`` elements (a larger parameter gets a bucket
of its own) and every bucket is padded to a multiple of the number of shards ``N``. Rank ``r`` owns
chunk ``r`` of *every* bucket; its shard is those chunks concatenated. This way the reduce-scatter
of one bucket writes straight into a contiguous range of the owner's shard, and the all-gather
after the step is one collective per bucket, with no re-packing on either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""

    index: int
    """Position of the parameter in its param group."""
    offset: int
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of the flat buffer, reduced and gathered by one collective."""

    index: int
    start: int
    end: int
    """End of the padded range (exclusive)."""
    data_end: int
    """End of the parameters' data inside it (the rest is padding)."""
    num_shards: int
    shard_offset: int
    """Where this bucket's chunk starts inside each rank's shard."""
    slots: tuple[int, ...]
    """Indices (into FlatLayout.slots) of the parameters in this bucket."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk(self) -> int:
        return self.numel // self.num_shards

    def chunk_range(self, shard: int) -> tuple[int, int]:
        """The flat range owned by ``shard`` inside this bucket."""
        lo = self.start + shard * self.chunk
        return lo, lo + self.chunk


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one param group: slots (flat order), buckets, sizes."""

    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]
    num_shards: int
    total: int
    """Padded length of the flat buffer."""

    @property
    def shard_numel(self) -> int:
        return self.total // self.num_shards

    def shard_ranges(self, shard: int) -> list[tuple[int, int, int]]:
        """(flat_start, flat_end, shard_offset) of every chunk that ``shard`` owns."""
        out = []
        for b in self.buckets:
            lo, hi = b.chunk_range(shard)
            out.append((lo, hi, b.shard_offset))
        return out

    def param_pieces_in_shard(self, shard: int) -> list[tuple[int, int, int, int]]:
        """(param_index, start_in_param, start_in_shard, length) for every piece of a parameter
        that lies in ``shard``: how per-parameter state maps into a rank's flat shard."""
        pieces = []
        for lo, hi, soff in self.shard_ranges(shard):
            for s in self.slots:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    pieces.append((s.index, a - s.offset, soff + (a - lo), b - a))
        return pieces


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(
    numels: Sequence[int], num_shards: int, bucket_numel: int, align: int = 1, reverse: bool = True
) -> FlatLayout:
    """Lay out parameters of the given sizes (in group order) into padded buckets.

    ``align`` makes every chunk a multiple of ``align`` elements (e.g. 8 for 16-byte vector access
    in 16-bit). ``reverse`` places the last parameter first (backward order).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    order = list(range(len(numels)))
    if reverse:
        order.reverse()
    pad_to = num_shards * max(1, align)
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    start = 0
    cur: list[tuple[int, int]] = []  # (param_index, numel)
    cur_numel = 0
    shard_offset = 0

    def close() -> None:
        nonlocal start, cur, cur_numel, shard_offset
        if not cur:
            return
        end = start + _round_up(max(cur_numel, 1), pad_to)
        idxs = []
        off = start
        for pi, n in cur:
            idxs.append(len(slots))
            slots.append(Slot(index=pi, offset=off, numel=n, bucket=len(buckets)))
            off += n
        b = Bucket(len(buckets), start, end, start + cur_numel, num_shards, shard_offset, tuple(idxs))
        buckets.append(b)
        shard_offset += b.chunk
        start = end
        cur, cur_numel = [], 0

    for pi in order:
        n = int(numels[pi])
        if cur and cur_numel + n > bucket_numel:
            close()
        cur.append((pi, n))
        cur_numel += n
    close()
    return FlatLayout(tuple(slots), tuple(buckets), num_shards, start)


def build_grouped_layout(
    numels: Sequence[int], keys: Sequence[int], key_order: Sequence[int], num_shards: int, align: int = 1
) -> tuple[FlatLayout, dict[int, int]]:
    """One bucket per key (stage 3: per unit), buckets in ``key_order``, parameters in group order.

    Returns the layout and key -> bucket index (keys without parameters get no bucket).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    pad_to = num_shards * max(1, align)
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    bucket_of: dict[int, int] = {}
    start = shard_offset = 0
    for key in key_order:
        members = [i for i, k in enumerate(keys) if k == key]
        if not members:
            continue
        n = sum(int(numels[i]) for i in members)
        end = start + _round_up(max(n, 1), pad_to)
        idxs, off = [], start
        for i in members:
            idxs.append(len(slots))
            slots.append(Slot(index=i, offset=off, numel=int(numels[i]), bucket=len(buckets)))
            off += int(numels[i])
        b = Bucket(len(buckets), start, end, start + n, num_shards, shard_offset, tuple(idxs))
        bucket_of[key] = b.index
        buckets.append(b)
        shard_offset += b.chunk
        start = end
    return FlatLayout(tuple(slots), tuple(buckets), num_shards, start), bucket_of
