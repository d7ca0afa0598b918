"""Pure partition math: every element of every parameter is owned by exactly one shard."""

from __future__ import annotations

import random

import pytest

from lightning_zero.zero.partition import build_layout


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 7, 50, 10_000])
def test_pieces_cover_every_element_once(num_shards: int, bucket: int) -> None:
    rng = random.Random(num_shards * 1000 + bucket)
    numels = [rng.randint(1, 40) for _ in range(9)]
    layout = build_layout(numels, num_shards, bucket, align=8)
    assert layout.total % num_shards == 0
    for b in layout.buckets:
        assert b.numel % (num_shards * 8) == 0 and b.data_end <= b.end
    covered = {i: [0] * n for i, n in enumerate(numels)}
    shard_sizes = []
    for shard in range(num_shards):
        used = set()
        for index, start, shard_start, length in layout.param_pieces_in_shard(shard):
            for k in range(length):
                covered[index][start + k] += 1
                assert shard_start + k not in used
                used.add(shard_start + k)
        assert all(0 <= u < layout.shard_numel for u in used)
        shard_sizes.append(layout.shard_numel)
    assert all(c == 1 for cs in covered.values() for c in cs)
    assert len(set(shard_sizes)) == 1


def test_reverse_order_and_bucket_cap() -> None:
    layout = build_layout([10, 20, 30], num_shards=2, bucket_numel=25)
    assert [s.index for s in layout.slots] == [2, 1, 0]  # backward order
    assert [len(b.slots) for b in layout.buckets] == [1, 1, 1]  # 30 alone; 20 then 10 exceed 25
    layout = build_layout([10, 20, 30], num_shards=2, bucket_numel=1000)
    assert len(layout.buckets) == 1 and layout.total == 60


def test_chunks_are_contiguous_in_the_shard() -> None:
    layout = build_layout([5, 6, 7, 8], num_shards=3, bucket_numel=9)
    offset = 0
    for b in layout.buckets:
        assert b.shard_offset == offset
        offset += b.chunk
    assert offset == layout.shard_numel


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        build_layout([1], 0, 10)
    with pytest.raises(ValueError):
        build_layout([1], 1, 0)
