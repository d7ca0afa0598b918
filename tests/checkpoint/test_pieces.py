"""FlatPiece's chunks (checkpoint/pieces.py [Note: tensor-parallel pieces]) against the tensor they stand for.

For random global shapes, TP blocks along any dim and ranges of the block's flattening (ZeRO's cuts),
every chunk a piece hands DCP, in the n-D and in the flat stored form, must hold exactly the global
tensor's elements at the chunk's place, the chunks must cover the range once, and a range splits into
at most 2 * ndim - 1 n-D boxes. Pure Python, no process group.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_zero.checkpoint.pieces import Block, FlatPiece, range_boxes


def _random_case(rng: random.Random) -> tuple[torch.Tensor, Block, int, int]:
    nd = rng.randint(1, 4)
    size = tuple(rng.randint(1, 5) for _ in range(nd))
    d = rng.randrange(nd)
    edges = sorted({0, size[d], *rng.sample(range(1, size[d]), rng.randint(0, size[d] - 1))})
    k = rng.randrange(len(edges) - 1)
    shape, offset = list(size), [0] * nd
    shape[d], offset[d] = edges[k + 1] - edges[k], edges[k]
    block = Block(tuple(shape), tuple(offset), size)
    n = block.numel
    lo = rng.randint(0, n - 1)
    return torch.arange(math.prod(size)).view(size), block, lo, rng.randint(lo + 1, n)


@pytest.mark.parametrize("nd_form", [True, False], ids=["nd", "flat"])
def test_chunks_hold_the_global_elements(nd_form: bool) -> None:
    rng = random.Random(0)
    for _ in range(400):
        glob, block, lo, hi = _random_case(rng)
        local = glob[tuple(slice(o, o + s) for o, s in zip(block.offset, block.shape))].reshape(-1)
        piece = FlatPiece(local[lo:hi].clone(), lo, block.numel, block, nd=nd_form)
        covered = 0
        for chunk, a, b in piece.chunks:
            if nd_form:
                want = glob[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            else:
                want = glob.reshape(-1)[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]]
            assert torch.equal(piece.source[a:b].view(chunk.sizes), want), (block, lo, hi, chunk)
            covered += b - a
        assert covered == hi - lo
        assert len(list(range_boxes(block.shape, lo, hi))) <= 2 * len(block.shape) - 1
        if block.is_whole and not nd_form:
            assert len(piece.chunks) == 1  # no tensor parallelism: the format is unchanged, one chunk


def test_row_shard_range_is_one_flat_chunk() -> None:
    """A Shard(0) block is contiguous in the global flattening too: any range of it is one flat run."""
    block = Block((2, 6), (4, 0), (8, 6))
    piece = FlatPiece(torch.zeros(7), 3, 12, block)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c, _, _ in piece.chunks] == [((27,), (7,))]


def test_stored_as_picks_the_form_or_refuses() -> None:
    block = Block((4, 3), (0, 3), (4, 6))
    piece = FlatPiece(torch.zeros(5), 2, 12, block)
    assert piece.stored_as((4, 6)).nd and not piece.stored_as((24,)).nd
    with pytest.raises(ValueError, match=r"stored with shape \[6, 4\], this run's tensor has shape \[4, 6\]"):
        piece.stored_as((6, 4))
    with pytest.raises(ValueError, match="shape"):
        piece.stored_as((25,))
