"""Ulysses sequence parallelism: two all-to-alls turn "every rank holds S/N tokens of every head" into
"every rank holds all S tokens of H/N heads" and back, so attention itself runs unsplit.

[Note: Ulysses]
Before attention, ``q``, ``k`` and ``v`` (``[B, H, S/N, D]`` on each of ``N`` ranks) are cut into ``N``
groups of heads; group ``j`` goes to rank ``j`` (one equal-split all-to-all, comm/collectives.all_to_all),
which concatenates the sequence slices it receives in rank order: ``[B, H/N, S, D]``. The tokens are then
in "rank order", which for the zigzag layout is not position order. Rows of one document are put back in
position order (one ``index_select`` of ``q, k, v`` and its inverse on the output, copies of this rank's
``1/N`` share; the permutation comes from the layout, on the host), so SDPA's fused causal path runs with
no mask: a mask built from the positions would be ``S x S`` per rank, kept for the backward, whatever ``N``.
Packed rows do build that mask from the gathered positions and document ids (blockwise.block_attention;
``O(S^2)`` memory: ring attention, whose masks are per block, is the scheme for long packed rows). After
attention the inverse all-to-all returns ``[B, H, S/N, D]``. The backward of each all-to-all is the other
one. Heads must divide by ``N``; grouped-query key/value heads that do not are repeated up to the query
heads first (DeepSpeed does the same), which costs their all-to-all volume and the memory of the repeats
(``H/N`` instead of ``KV/N`` key/value heads per rank).
Communication per attention: ``4`` all-to-alls of ``1/N`` of the activations each way, against ring
attention's ``N - 1`` key/value block exchanges: Ulysses wins while heads divide, ring is the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.sequence.blockwise import block_attention, plain_attention
from lightning_zero.sequence.layout import SequenceLayout


def _seq_to_heads(x: Tensor, group: Optional[C.ProcessGroup]) -> Tensor:
    """``[B, H, S/N, D]`` -> ``[B, H/N, S, D]`` (sequence slices in rank order)."""
    n = C.world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    C.all_to_all(recv, send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: Tensor, group: Optional[C.ProcessGroup]) -> Tensor:
    """``[B, H/N, S, D]`` -> ``[B, H, S/N, D]``, the inverse of :func:`_seq_to_heads`."""
    n = C.world_size(group)
    b, hn, s, d = x.shape
    send = x.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    C.all_to_all(recv, send, group)
    return recv.transpose(0, 1).reshape(b, n * hn, s // n, d)


class _Reshard(torch.autograd.Function):
    """Sequence-sharded -> head-sharded (``to_heads``) or back; the backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[C.ProcessGroup], to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return (_heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)), None, None


def _gather_doc(doc: Tensor, group: Optional[C.ProcessGroup]) -> Tensor:
    """Every rank's ``[B, S/N]`` document ids, ``[B, S]`` in rank order."""
    n = C.world_size(group)
    out = torch.empty(n * doc.numel(), dtype=doc.dtype, device=doc.device)
    C.all_gather(out, doc.reshape(-1).contiguous(), group)
    return out.view((n,) + tuple(doc.shape)).permute(1, 0, 2).reshape(doc.shape[0], -1)


@dataclass(frozen=True)
class TokenOrder:
    """Where this layout's tokens sit once the all-to-all has put them in rank order, made once per layout
    and device (see [Note: no host round trip per call])."""

    positions: Tensor
    """``[S]`` global positions of the tokens in rank order, on the device."""
    to_pos: Optional[Tensor]
    """Rank order -> position order (``index_select`` along the sequence), None when they are the same."""
    to_rank: Optional[Tensor]
    """Position order -> rank order, the inverse of ``to_pos``."""


def token_order(layout: SequenceLayout, device: torch.device) -> TokenOrder:
    """The :class:`TokenOrder` of ``layout`` on ``device`` (host work and two host-to-device copies)."""
    pos = torch.cat([layout.positions(r) for r in range(layout.size)])
    if bool((pos[1:] > pos[:-1]).all()):  # rank order is position order (contiguous layout)
        return TokenOrder(pos.to(device), None, None)
    order = torch.argsort(pos)
    return TokenOrder(pos.to(device), order.to(device), torch.argsort(order).to(device))


# [Note: no host round trip per call]
# A host tensor copied to the GPU from pageable memory makes the host wait until the stream has drained, so a
# permutation built on the host in every attention call (forward, and again in the recomputed forward) stalls
# the host once per layer: ZeRO-3's prefetch of the next layer can then no longer run ahead of the compute
# (measured on 4 x H200, 2026-11-28: the NCCL time was almost entirely exposed, RESULTS.md). The order depends
# on the layout only, so the sequence context (context.py) makes it once per layout and device and every
# call reuses it; the unmasked causal path then needs no positions at all.


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, group: Optional[C.ProcessGroup],
                      doc: Optional[Tensor] = None, causal: bool = True, scale: Optional[float] = None,
                      order: Optional[TokenOrder] = None) -> Tensor:
    """Attention of this rank's tokens over the whole sequence of the group through two all-to-alls
    (see [Note: Ulysses]); ``[B, H, S_local, D]`` in and out, ``k``/``v`` may have fewer heads. ``order``:
    :func:`token_order` of ``layout`` on ``q``'s device, made here when not given."""
    n = C.world_size(group)
    if layout.size != n:
        raise ValueError(f"layout for {layout.size} ranks used on a group of {n}")
    heads = q.shape[1]
    if heads % n:
        raise ValueError(f"Ulysses needs the {heads} attention heads to divide by sequence parallel {n}: "
                         "use ring attention (sp_attention='ring')")
    if k.shape[1] % n:  # grouped-query heads that do not split: repeat them up to the query heads
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    order = order if order is not None else token_order(layout, q.device)
    qh, kh, vh = (_Reshard.apply(t, group, True) for t in (q, k, v))
    if doc is not None:
        full_doc = _gather_doc(doc, group)
        out = block_attention(qh, kh, vh, order.positions, order.positions, full_doc, full_doc, causal=causal,
                              scale=scale)
    elif order.to_pos is None:  # rank order is position order: SDPA's own causal path
        out = plain_attention(qh, kh, vh, causal, scale)
    else:  # position order for SDPA's unmasked causal path, rank order again after (see [Note: Ulysses])
        assert order.to_rank is not None
        qh, kh, vh = (t.index_select(2, order.to_pos) for t in (qh, kh, vh))
        out = plain_attention(qh, kh, vh, causal, scale).index_select(2, order.to_rank)
    return _Reshard.apply(out, group, False)

