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
them. Block pairs go through torch's fused flash kernels where they can, the rest through plain torch
(blockwise.py): [Note: fused blocks].

[Note: fused blocks]
Why: plain-torch blocks materialise the fp32 ``Sq x Sk`` scores (and in the backward the probabilities and
their gradient) of every block pair; on 4 x H200 at 32K tokens that made ring attention 7x slower than
Ulysses at almost 3x its peak memory (benchmarks/RESULTS.md). torch's flash kernels (flash.py: CPU
``_scaled_dot_product_flash_attention_for_cpu``, CUDA ``_scaled_dot_product_flash_attention``) keep the
scores in tiles and return the block's log-sum-exp, which is all blockwise.merge needs.
How: flash.plan decides per block pair, on the host from the global positions, whether its visible part
is one rectangle the kernel computes without a mask: queries ``rows:`` against keys ``:keys``, all
visible (a block entirely before this rank's tokens, or half of one in the zigzag layout) or causal on
the diagonal (the rank's own block). The forward merges the kernel's ``(o_b, lse_b)`` into those rows in
fp32. The backward calls the kernel's backward per block with the *merged* output and log-sum-exp of
all blocks, not the block's own: the kernel recomputes ``P_b = exp(S_b - lse)`` and ``D = rowsum(dO * o)``
from them, which are then exactly the block's share of the global softmax's gradient (blockwise.py
[Note: merging partial softmaxes]), so ``dq, dk, dv`` accumulate over blocks as on the plain path. The
kernels run in the inputs' dtype (bf16 on GPUs) and return an fp32 log-sum-exp; merges and accumulators
stay fp32.
What stays plain: document masks of packed sequences (a block's visible part is then no rectangle),
positions that are not ascending, flash SDPA switched off by the user, dtypes or head dims the kernel
refuses (flash.kernel_takes: fp32 on CUDA among them). The choice changes nothing beyond the kernels'
rounding: tests/sequence checks both paths against one-process attention (test_ring_fused.py plays the
ring's schedule in one process; the 2- and 4-rank runs count the fused calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.sequence import blockwise as B
from lightning_zero.sequence import flash as FL
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


def _merge_rows(out: Tensor, lse: Tensor, o_b: Tensor, lse_b: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """blockwise.merge of a fused block that covers queries ``rows:`` only (flash.FusedBlock)."""
    if rows == 0:
        return B.merge(out, lse, o_b, lse_b)
    out[:, :, rows:], lse[:, :, rows:] = B.merge(out[:, :, rows:], lse[:, :, rows:], o_b, lse_b)
    return out, lse


def _positions(layout: SequenceLayout, owner: int) -> Tensor:
    """The global positions of ``owner``'s tokens, on the host: flash.plan and _skip read them there; only a
    plain-path block copies them to the device (:func:`_visible`), so the fused path makes no copy per block."""
    return layout.positions(owner)


def _visible(me: "_Queries", k_host: Tensor, k_doc: Optional[Tensor]) -> Tensor:
    """blockwise.visible of a plain-path block, the positions copied to the queries' device."""
    dev = me.q.device
    return B.visible(me.host.to(dev, non_blocking=True), k_host.to(dev, non_blocking=True), me.doc, k_doc, me.causal)


@dataclass(frozen=True)
class _Queries:
    """This rank's side of every block pair: its queries, their positions (host), document ids."""

    q: Tensor
    host: Tensor
    doc: Optional[Tensor]
    causal: bool
    scale: float


@dataclass(frozen=True)
class _Upstream:
    """What every block's backward reads: the output's gradient, the merged output (in ``q``'s dtype for the
    fused kernel, fp32 ``delta = rowsum(dout * out)`` for the plain path), the merged lse, the kernel's rng."""

    dout: Tensor
    out: Tensor
    lse: Tensor
    delta: Tensor
    rng: Any


def _fold_block(me: _Queries, k: Tensor, v: Tensor, k_at: Tensor, k_doc: Optional[Tensor],
                out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Any]:
    """Fold one key/value block (positions ``k_at``, host) into the running fp32 ``(out, lse)``:
    the fused kernel where flash.plan allows it ([Note: fused blocks]), plain torch otherwise, nothing when
    no query sees a key. Returns the new ``(out, lse)`` and the kernel's rng tensors (or None)."""
    if _skip(me.host, k_at, me.causal):
        return out, lse, None
    fused = FL.plan(me.host, k_at, me.causal, me.doc is not None, me.q)
    if fused is not None:
        o_b, lse_b, rng = FL.forward(me.q, k, v, fused, me.scale)
        return (*_merge_rows(out, lse, o_b, lse_b, fused.rows), rng)
    o_b, lse_b = B.block_forward(me.q, k, v, _visible(me, k_at, k_doc), me.scale)
    return (*B.merge(out, lse, o_b, lse_b), None)


def _add_block_grads(me: _Queries, k: Tensor, v: Tensor, k_at: Tensor, k_doc: Optional[Tensor],
                     up: _Upstream, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Add one block's share of the gradients, in place: to ``dq`` (this rank's queries) and to the block's
    travelling accumulators ``dk, dv``; the same path choice as :func:`_fold_block`."""
    if _skip(me.host, k_at, me.causal):
        return
    fused = FL.plan(me.host, k_at, me.causal, me.doc is not None, me.q)
    if fused is not None:  # the merged output and lse: [Note: fused blocks]
        dq_b, dk_b, dv_b = FL.backward(me.q, k, v, fused, me.scale, up.dout, up.out, up.lse, up.rng)
        dq[:, :, fused.rows:] += dq_b
        dk[:, :, :fused.keys] += dk_b
        dv[:, :, :fused.keys] += dv_b
        return
    mask = _visible(me, k_at, k_doc)
    dq_b, dk_b, dv_b = B.block_backward(me.q, k, v, mask, me.scale, up.dout, up.lse, up.delta)
    dq += dq_b
    dk += dk_b
    dv += dv_b


class _RingAttention(torch.autograd.Function):
    """See [Note: the ring]."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, doc: Optional[Tensor],
                causal: bool, scale: float, group: Optional[C.ProcessGroup]) -> Tensor:
        n, r = C.world_size(group), C.rank(group)
        me = _Queries(q, _positions(layout, r), doc, causal, scale)
        block = [k, v] + ([doc] if doc is not None else [])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        rng = None
        for t in range(n):
            works: list[Any] = []
            if t < n - 1:
                nxt, works = _rotate(block, group)
            at = _positions(layout, (r - t) % n)  # no name outlives the block: two live, never three
            out, lse, got = _fold_block(me, block[0], block[1], at, block[2] if doc is not None else None, out, lse)
            rng = got if got is not None else rng
            if t < n - 1:
                _arrive(works)
                block = nxt
        ctx.save_for_backward(q, k, v, out, lse, *([doc] if doc is not None else []))
        ctx.causal, ctx.scale, ctx.group, ctx.has_doc, ctx.layout = causal, scale, group, doc is not None, layout
        ctx.rng = rng  # the CUDA kernel's rng tensors (tiny; unread at dropout 0), None on CPU: flash.py
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, *rest = ctx.saved_tensors
        doc = rest[0] if ctx.has_doc else None
        group = ctx.group
        n, r = C.world_size(group), C.rank(group)
        me = _Queries(q, _positions(ctx.layout, r), doc, ctx.causal, ctx.scale)
        dout = dout.contiguous()  # the kernels read strides; autograd may hand an expanded gradient
        # out in q's dtype is what the fused backward takes (no copy in fp32)
        up = _Upstream(dout, out.to(q.dtype), lse, (dout.float() * out).sum(-1), ctx.rng)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = [k, v] + ([doc] if doc is not None else [])
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for t in range(n):
            at = _positions(ctx.layout, (r - t) % n)
            _add_block_grads(me, block[0], block[1], at, block[2] if doc is not None else None, up, dq, dk, dv)
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
