"""Attention over one block of keys, with the log-sum-exp that lets blocks be merged (flash attention's
online softmax, written in plain torch so that it runs and is checked on the CPU).

[Note: merging partial softmaxes]
For queries ``Q`` and one block ``b`` of keys, ``o_b = softmax(S_b) V_b`` and ``lse_b = logsumexp(S_b)`` per
row, ``S_b = Q K_b^T * scale`` with masked entries at ``-inf``. Over two blocks the exact result is
``o = o_1 exp(lse_1 - lse) + o_2 exp(lse_2 - lse)`` with ``lse = logaddexp(lse_1, lse_2)``, so a rank can
attend to the key blocks one at a time, in any order, and end with softmax over all of them. A row with no
visible key in a block has ``lse_b = -inf`` and contributes nothing. The backward needs only the final
``o`` and ``lse``: per block ``P_b = exp(S_b - lse)``, ``dV_b = P_b^T dO``, ``dS_b = P_b (dO V_b^T - D)``
with ``D = rowsum(dO * o)``, ``dQ += dS_b K_b scale``, ``dK_b = dS_b^T Q scale``. Everything is computed
in fp32 and cast back to the inputs' dtype at the end.

Grouped-query attention (fewer key/value heads than query heads) repeats each key/value head over its
group of query heads inside the block, and sums the group's gradients back; what travels between ranks
is the un-repeated key/value.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def visible(q_pos: Tensor, k_pos: Tensor, q_doc: Optional[Tensor], k_doc: Optional[Tensor],
            causal: bool) -> Optional[Tensor]:
    """Which keys each query sees, ``[B or 1, 1, Sq, Sk]`` bool, or None when it sees all of them.
    Positions are global token indices ``[Sq]``/``[Sk]``; ``*_doc`` (``[B, S]``, optional) the document
    each token belongs to in a packed sequence: a query sees only keys of its own document."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if q_doc is not None and k_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """Repeat each key/value head over its group of query heads (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_kv(grad: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradients of a repeated key/value head over its group (the inverse of ``_expand_kv``)."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    s = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor]:
    """``(o_b, lse_b)`` of one key block, fp32: ``o_b`` ``[B, H, Sq, D]`` normalised over this block, ``lse_b``
    ``[B, H, Sq]`` (``-inf`` on rows with no visible key, whose ``o_b`` is 0)."""
    s = _scores(q, k, mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.matmul(p, _expand_kv(v, q.shape[1]).float()) / l.clamp_min(torch.finfo(torch.float32).tiny)
    return o, (m + torch.log(l)).squeeze(-1)


def merge(o: Tensor, lse: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Fold block ``(o_b, lse_b)`` into the running ``(o, lse)`` (see [Note: merging partial softmaxes])."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    o = o * torch.exp(lse - safe).unsqueeze(-1) + o_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return o, new


def block_backward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, dout: Tensor,
                   lse: Tensor, delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(dq, dk, dv)`` of one key block, given the final ``lse`` and ``delta = rowsum(dout * out)``;
    ``dk``/``dv`` have the key/value heads' shape."""
    s = _scores(q, k, mask, scale)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    p = torch.exp(s - safe)
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, _expand_kv(v, q.shape[1]).float().transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, _expand_kv(k, q.shape[1]).float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _fold_kv(dk, k.shape[1]), _fold_kv(dv, v.shape[1])


def default_scale(q: Tensor, scale: Optional[float]) -> float:
    """SDPA's default: ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def plain_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float]) -> Tensor:
    """Attention of tokens in position order over themselves: SDPA's own (fused) causal path, no mask."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=default_scale(q, scale),
                                          enable_gqa=k.shape[1] != q.shape[1])


def block_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, q_doc: Optional[Tensor] = None,
                    k_doc: Optional[Tensor] = None, causal: bool = True, scale: Optional[float] = None) -> Tensor:
    """Differentiable attention of ``q`` over ``k``/``v`` whose tokens sit at arbitrary global positions
    (``[B, H, S, D]`` layout, ``k``/``v`` may have fewer heads): SDPA with the mask the positions imply,
    or SDPA's own causal path when both hold the same ascending run of positions (its fused kernels)."""
    scale = default_scale(q, scale)
    gqa = k.shape[1] != q.shape[1]
    plain = q_doc is None and q_pos.shape == k_pos.shape and bool((q_pos == k_pos).all()) \
        and bool((q_pos[1:] > q_pos[:-1]).all())
    if plain:
        return plain_attention(q, k, v, causal, scale)
    mask = visible(q_pos.to(q.device), k_pos.to(q.device), q_doc, k_doc, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, doc: Optional[Tensor] = None, causal: bool = True,
                        scale: Optional[float] = None) -> Tensor:
    """The oracle: attention over the whole sequence on one process (positions ``0..S-1``)."""
    pos = torch.arange(q.shape[2], device=q.device)
    mask = visible(pos, pos, doc, doc, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=default_scale(q, scale),
                                          enable_gqa=k.shape[1] != q.shape[1])
