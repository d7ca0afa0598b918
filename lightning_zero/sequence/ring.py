"""Ring attention: each rank keeps its queries and passes its key/value block around the sequence-parallel
group, so besides its own a rank holds at most two key/value blocks: the one it attends to and the one in flight.

[Note: the ring]
Forward, ``N`` ranks: at step ``t`` rank ``r`` holds the key/value block of rank ``(r - t) mod N``, posts
the send of that block to ``r + 1`` and the receive of the next one from ``r - 1`` (one batched exchange,
comm/collectives.send_recv, started before the block's compute so the transfer overlaps it), attends to the
block and merges the result by its log-sum-exp (blockwise.py [Note: merging partial softmaxes]). Each
block's global positions follow from its owner's rank and the layout (layout.py), on the host, so the mask
is built and a block whose every key lies after every query of this rank (causal) is skipped without
reading anything back from the device; packed sequences' document ids travel with the block. Backward runs the
same ring again: each block travels with its gradient accumulators ``dK, dV``; every rank adds its
queries' contribution to the block it holds before passing it on, and after ``N`` passes the block (only
its accumulators are sent on the last one) is home with its complete gradient. ``dQ`` never moves.

Memory: the saved tensors are this rank's ``q, k, v, out, lse``; nothing of size ``S x S`` or of the whole
sequence is kept. Received blocks live while attended to and while the next one arrives: at most two
besides the rank's own (forward), two with their ``dK, dV`` accumulators (backward); tests/sequence counts
them. The compute per block is plain torch (blockwise.py), so the same code runs on gloo in CI;
on GPUs a fused kernel returning the log-sum-exp can replace ``block_forward``/``block_backward``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.sequence import blockwise as B
from lightning_zero.sequence.layout import SequenceLayout


def _rotate(tensors: list[Tensor], group: Optional[C.ProcessGroup]) -> tuple[list[Tensor], list[Any]]:
    """Post the send of ``tensors`` to the next rank and the receive of the previous rank's into new
    buffers; return the buffers and the work handles (waited by ``_arrive``)."""
    n, r = C.world_size(group), C.rank(group)
    bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous, whatever t's strides
    works = C.send_recv([(t.contiguous(), (r + 1) % n) for t in tensors], [(b, (r - 1) % n) for b in bufs],
                        group, wait=False)
    return bufs, works


def _arrive(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _exchange(tensors: list[Tensor], group: Optional[C.ProcessGroup]) -> list[Tensor]:
    """``_rotate`` and wait; only the received buffers are returned: the work handles, which keep the sent
    tensors alive, end here (kept until the next exchange they would make three blocks live, not two)."""
    bufs, works = _rotate(tensors, group)
    _arrive(works)
    return bufs


def _skip(q_pos: Tensor, k_pos: Tensor, causal: bool) -> bool:
    """True when no query of this rank sees any key of the block (every key after every query); host
    tensors, so deciding costs no device read."""
    return causal and int(k_pos.min()) > int(q_pos.max())


def _positions(layout: SequenceLayout, owner: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The host and device copies of the positions of ``owner``'s tokens."""
    pos = layout.positions(owner)
    return pos, pos.to(device, non_blocking=True)


class _RingAttention(torch.autograd.Function):
    """See [Note: the ring]."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, doc: Optional[Tensor],
                causal: bool, scale: float, group: Optional[C.ProcessGroup]) -> Tensor:
        n, r = C.world_size(group), C.rank(group)
        q_host, q_pos = _positions(layout, r, q.device)
        block = [k, v] + ([doc] if doc is not None else [])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for t in range(n):
            works: list[Any] = []
            if t < n - 1:
                nxt, works = _rotate(block, group)
            k_host, k_pos = _positions(layout, (r - t) % n, q.device)
            if not _skip(q_host, k_host, causal):  # no name outlives the block: two blocks live, never three
                mask = B.visible(q_pos, k_pos, doc, block[2] if doc is not None else None, causal)
                o_b, lse_b = B.block_forward(q, block[0], block[1], mask, scale)
                out, lse = B.merge(out, lse, o_b, lse_b)
            if t < n - 1:
                _arrive(works)
                block = nxt
        ctx.save_for_backward(q, k, v, out, lse, *([doc] if doc is not None else []))
        ctx.causal, ctx.scale, ctx.group, ctx.has_doc, ctx.layout = causal, scale, group, doc is not None, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, *rest = ctx.saved_tensors
        doc = rest[0] if ctx.has_doc else None
        group = ctx.group
        n, r = C.world_size(group), C.rank(group)
        q_host, q_pos = _positions(ctx.layout, r, q.device)
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = [k, v] + ([doc] if doc is not None else [])
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for t in range(n):
            bk, bv = block[0], block[1]
            bdoc = block[2] if doc is not None else None
            k_host, k_pos = _positions(ctx.layout, (r - t) % n, q.device)
            if not _skip(q_host, k_host, ctx.causal):
                mask = B.visible(q_pos, k_pos, doc, bdoc, ctx.causal)
                dq_b, dk_b, dv_b = B.block_backward(q, bk, bv, mask, ctx.scale, dout, lse, delta)
                dq += dq_b
                dk += dk_b
                dv += dv_b
            if n > 1:  # the block moves on with its accumulators; on the last pass only they travel (home)
                *block, dk, dv = _exchange((block if t < n - 1 else []) + [dk, dv], group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, group: Optional[C.ProcessGroup],
                   doc: Optional[Tensor] = None, causal: bool = True, scale: Optional[float] = None) -> Tensor:
    """Attention of this rank's queries over the whole sequence of the group (``[B, H, S_local, D]``,
    ``k``/``v`` may have fewer heads). ``layout``: which tokens each rank of ``group`` holds (its size is
    the group's), ``doc``: ``[B, S_local]`` document ids of packed sequences."""
    if layout.size != C.world_size(group):
        raise ValueError(f"layout for {layout.size} ranks used on a group of {C.world_size(group)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    return _RingAttention.apply(q, k, v, layout, doc, causal, B.default_scale(q, scale), group)
