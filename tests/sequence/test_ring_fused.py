"""Ring attention's block pairs through torch's fused flash kernels (ring.py [Note: fused blocks]), on one
process: which pairs flash.plan sends to the kernel, and the ring's block schedule played for every rank
in-process with ring.py's own block steps (_fold_block, _add_block_grads) against attention over the whole
sequence (outputs and q/k/v gradients, fp32), for causal zigzag and contiguous layouts, fully visible
attention, grouped-query heads and odd block lengths; document masks take the plain path, still exact."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from lightning_zero.sequence import SequenceLayout, attention_reference, ring_attention
from lightning_zero.sequence import flash as FL
from lightning_zero.sequence import ring as R
from tests.helpers.compare import tensor_rel
from tests.sequence.sp_attn_worker import packed_docs

TOL = 1e-5


@contextmanager
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the kernel calls ring.py makes through flash.forward / flash.backward."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        original = getattr(FL, name)

        def counted(*args, _name=name, _fn=original, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(FL, name, counted)
    yield calls


def test_plan_takes_the_layouts_rectangles_and_leaves_documents_plain() -> None:
    x = torch.zeros(1, 1, 8, 8)
    zig = SequenceLayout(32, 4, "zigzag")  # rank 1 holds chunks 1 and 6 of 8 (4 tokens each)
    p = zig.positions
    assert FL.plan(p(1), p(1), True, False, x) == FL.FusedBlock(0, 8, True)  # own block: causal diagonal
    assert FL.plan(p(1), p(0), True, False, x) == FL.FusedBlock(0, 4, False)  # earlier rank: its first chunk
    assert FL.plan(p(1), p(3), True, False, x) == FL.FusedBlock(4, 8, False)  # later rank: our second chunk
    contiguous = SequenceLayout(32, 4, "contiguous").positions
    assert FL.plan(contiguous(2), contiguous(0), True, False, x) == FL.FusedBlock(0, 8, False)
    assert FL.plan(p(1), p(3), False, False, x) == FL.FusedBlock(0, 8, False)  # no mask at all
    assert FL.plan(p(1), p(1), True, True, x) is None  # document masks: plain
    assert FL.plan(p(1), p(1), True, False, x.double()) is None  # a dtype the kernel path does not take
    assert FL.plan(p(1), p(1), True, False, x.bfloat16()) == FL.FusedBlock(0, 8, True)
    assert FL.plan(torch.tensor([0, 2, 6]), torch.tensor([1, 2, 3]), True, False, x) is None  # no rectangle
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)  # the user's switch, which SDPA obeys on CPU too
    try:
        assert FL.plan(p(1), p(1), True, False, x) is None
    finally:
        torch.backends.cuda.enable_flash_sdp(was)


def _ring_in_process(q, k, v, layout: SequenceLayout, doc, causal: bool, dout):
    """Every rank's forward and backward of ring.py's schedule, played in one process with its own block
    steps; returns the full-sequence output and q/k/v gradients (fp32), reassembled by the layout."""
    n, scale = layout.size, q.shape[-1] ** -0.5
    shard = [[layout.shard(t, r, dim=2) for r in range(n)] for t in (q, k, v, dout)]
    docs = [layout.shard(doc, r, dim=1) if doc is not None else None for r in range(n)]
    me = [R._Queries(shard[0][r], R._positions(layout, r), docs[r], causal, scale) for r in range(n)]
    outs, ups = [], []
    for r in range(n):
        out = torch.zeros(me[r].q.shape)
        lse = torch.full(me[r].q.shape[:-1], float("-inf"))
        for t in range(n):
            s = (r - t) % n
            out, lse, _ = R._fold_block(me[r], shard[1][s], shard[2][s], R._positions(layout, s),
                                        docs[s], out, lse)
        outs.append(out)
        d = shard[3][r]
        ups.append(R._Upstream(d, out.to(q.dtype), lse, (d.float() * out).sum(-1), None))
    dq = [torch.zeros(t.shape) for t in shard[0]]
    dk, dv = [torch.zeros(t.shape) for t in shard[1]], [torch.zeros(t.shape) for t in shard[2]]
    for r in range(n):
        for t in range(n):
            s = (r - t) % n
            R._add_block_grads(me[r], shard[1][s], shard[2][s], R._positions(layout, s), docs[s], ups[r],
                               dq[r], dk[s], dv[s])
    return [layout.unshard(parts, dim=2) for parts in (outs, dq, dk, dv)]


CASES = {
    "zigzag_causal": dict(kind="zigzag", n=4, seq=32),
    "zigzag_odd_blocks": dict(kind="zigzag", n=2, seq=12),  # chunks of 3 tokens, rectangles of odd size
    "contiguous_odd_gqa": dict(kind="contiguous", n=3, seq=15, kv_heads=2),
    "zigzag_gqa_one_kv_head": dict(kind="zigzag", n=2, seq=16, kv_heads=1),
    "fully_visible": dict(kind="zigzag", n=4, seq=16, causal=False),
    "documents_plain": dict(kind="zigzag", n=2, seq=24, kv_heads=2, doc=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_ring_schedule_equals_the_whole_sequence(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    c = {"kv_heads": 4, "causal": True, "doc": False, **CASES[case]}
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, h, c["seq"], 8, generator=g) for h in (4, c["kv_heads"], c["kv_heads"], 4))
    doc = packed_docs(2, c["seq"]) if c["doc"] else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*full, doc=doc, causal=c["causal"])
    ref.backward(dout)
    layout = SequenceLayout(c["seq"], c["n"], c["kind"])
    with fused_calls(monkeypatch) as calls:
        got = _ring_in_process(q, k, v, layout, doc, c["causal"], dout)
    for name, mine, want in zip(("out", "dq", "dk", "dv"), got, (ref, *(t.grad for t in full))):
        assert tensor_rel(mine, want.detach()) < TOL, (case, name, tensor_rel(mine, want.detach()))
    # every pair with a visible key went through the kernel, none when documents are packed
    pairs = sum(not R._skip(layout.positions(r), layout.positions(s), c["causal"])
                for r in range(c["n"]) for s in range(c["n"]))
    assert calls == ({"forward": 0, "backward": 0} if c["doc"] else {"forward": pairs, "backward": pairs})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_ring_runs_the_kernel_in_the_inputs_dtype(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the autograd Function: the output and gradients keep the inputs' dtype; fp32 matches the
    reference to rounding, bf16 to bf16's."""
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(2, h, 10, 8, generator=g) for h in (4, 2, 2, 4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*full)
    ref.backward(dout)
    mine = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    with fused_calls(monkeypatch) as calls:
        out = ring_attention(*mine, SequenceLayout(10, 1, "contiguous"), None)
        out.backward(dout.to(dtype))
    assert calls == {"forward": 1, "backward": 1} and out.dtype == dtype
    tol = TOL if dtype == torch.float32 else 2e-2
    for got, want in zip((out, *(t.grad for t in mine)), (ref, *(t.grad for t in full))):
        assert got.dtype == dtype and tensor_rel(got.float(), want.detach()) < tol
