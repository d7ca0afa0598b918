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
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

from lightning_zero.checkpoint.pieces import Block, FlatPiece, PieceLoadPlanner, range_boxes


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


def _read_through_planner(piece: FlatPiece, stored: torch.Tensor, cuts: list[int]) -> int:
    """Fill ``piece.source`` as DCP would from ``stored`` (the global tensor in the piece's stored
    form, written as the chunks between ``cuts`` of its first dim): the load planner's plan, each
    item narrowed out of its stored chunk, resolved, copied and committed. Returns the item count."""
    size = tuple(stored.shape)
    chunks = []
    for a, b in zip(cuts, cuts[1:]):
        chunks.append(ChunkStorageMetadata(torch.Size([a, *([0] * (len(size) - 1))]), torch.Size([b - a, *size[1:]])))
    md = Metadata({"t": TensorStorageMetadata(TensorProperties(dtype=stored.dtype), torch.Size(size), chunks)})
    planner = PieceLoadPlanner()
    planner.set_up_planner({"t": piece}, md)
    items = planner.create_local_plan().items
    for item in items:
        chunk = chunks[[tuple(c.offsets) for c in chunks].index(tuple(item.storage_index.offset))]
        data = stored[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
        data = data[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
        target = planner.resolve_tensor(item)
        target.copy_(data)
        planner.commit_tensor(item, target)
    return len(items)


def test_column_block_reads_in_a_few_requests() -> None:
    """A tp-2 rank's Shard(1) block (RowwiseParallel's weight) of a 4096 x 4096 tensor, a ZeRO range
    across ~2048 of its rows: <= 3 requests in either stored form (not one per row), and the data read
    through them is exactly the block's range of a reference tensor."""
    rows, cols = 4096, 4096
    glob = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)  # exact below 2**24
    block = Block((rows, cols // 2), (0, cols // 2), (rows, cols))
    lo, hi = 1000, 1000 + block.numel // 2
    want = glob[:, cols // 2 :].reshape(-1)[lo:hi]
    for size, stored, cuts in (((rows * cols,), glob.reshape(-1), [0, 5_000_000, 9_000_001, rows * cols]),
                               ((rows, cols), glob, [0, 1000, 3001, rows])):
        piece = FlatPiece(torch.full((hi - lo,), -1.0), lo, block.numel, block).stored_as(size)
        assert len(piece.__create_chunk_list__()) <= 3, size
        assert _read_through_planner(piece, stored, cuts) <= 3 + len(cuts), size
        assert torch.equal(piece.source, want), size


def test_spanned_reads_hold_the_global_elements() -> None:
    """Flat-stored tensors read into TP blocks through a span ([Note: strided reads of flat tensors]):
    for random blocks, ranges and writers' cuts, exactly the block's elements arrive, and the plan
    keeps no item that holds none of them."""
    rng = random.Random(1)
    spanned = 0
    for _ in range(300):
        glob, block, lo, hi = _random_case(rng)
        flat = glob.reshape(-1)
        local = glob[tuple(slice(o, o + s) for o, s in zip(block.offset, block.shape))].reshape(-1)
        piece = FlatPiece(torch.full((hi - lo,), -1, dtype=glob.dtype), lo, block.numel, block).stored_as((flat.numel(),))
        spanned += piece.span is not None
        n = flat.numel()
        cuts = sorted({0, n, *rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))})
        _read_through_planner(piece, flat, cuts)
        assert torch.equal(piece.source, local[lo:hi]), (block, lo, hi, cuts)
        assert len(piece.__create_chunk_list__()) == 1
    assert spanned > 30  # the random cases do exercise the span


def test_items_between_the_elements_are_dropped() -> None:
    """A writer's chunk lying wholly in another TP rank's columns is not read at all."""
    glob = torch.arange(24).view(4, 6)
    block = Block((4, 3), (0, 0), (4, 6))
    piece = FlatPiece(torch.full((12,), -1), 0, 12, block).stored_as((24,))
    assert piece.span == (0, 21)
    assert _read_through_planner(piece, glob.reshape(-1), [0, 3, 6, 24]) == 2  # [3, 6) is row 0's other half
    assert torch.equal(piece.source, glob[:, :3].reshape(-1))


def test_wrapped_entries_are_saved_under_their_own_names(tmp_path) -> None:
    """PieceSavePlanner.wrap hands DCP one top-level key (its per-key Stateful check is costly); the planner
    unwraps it, so the checkpoint holds the entries' own names and loads back into them."""
    import torch.distributed.checkpoint as dcp

    from lightning_zero.checkpoint.pieces import PieceSavePlanner

    import warnings

    entries = {"layer.weight": torch.arange(6.0).view(2, 3), "step": 7}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(PieceSavePlanner.wrap(entries), checkpoint_id=str(tmp_path), planner=PieceSavePlanner(), no_dist=True)
    assert not [w for w in caught if "set_up_planner" in str(w.message)]  # DCP reads the planner's signature
    names = set(dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata)
    assert names == {"layer.weight", "step"}
    back = {"layer.weight": torch.zeros(2, 3), "step": 0}
    dcp.load(back, checkpoint_id=str(tmp_path), planner=PieceLoadPlanner(), no_dist=True)
    assert torch.equal(back["layer.weight"], entries["layer.weight"]) and back["step"] == 7
