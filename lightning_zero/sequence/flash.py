"""Ring attention's block pairs through torch's fused flash-attention kernels, which return the block's
log-sum-exp, so their results merge like blockwise.py's (see ring.py [Note: fused blocks]).

Which block pairs qualify is decided on the host from the tokens' global positions (:func:`plan`): the
visible part of a pair must be one rectangle the kernel computes without a mask, all visible or causal on
its diagonal. Everything else (document masks of packed sequences, dtypes or head dims the kernel refuses)
stays on blockwise.py's plain path, which is also the reference the fused path is tested against.

Kernel signatures, read from the installed torch (``torch.ops.aten.<op>.default._schema``, torch 2.13) and
its ``torch/_meta_registrations.py``:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p=0., is_causal=False, *,
  attn_mask=None, scale=None) -> (output, logsumexp)``, ``logsumexp`` ``[B, H, Sq]`` in the computation
  dtype (fp32 for bf16/fp16/fp32); ``_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query,
  key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None) -> (grad_query,
  grad_key, grad_value)``.
- CUDA: ``_scaled_dot_product_flash_attention(query, key, value, dropout_p=0., is_causal=False,
  return_debug_mask=False, *, scale=None) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
  rng_state, unused, debug_attn_mask)`` (positions 6 and 7 were named ``philox_seed, philox_offset``
  before torch 2.6; same positions), ``logsumexp`` ``[B, H, Sq]`` fp32;
  ``_scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q,
  cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None) -> (grad_query,
  grad_key, grad_value)``. torch's own context parallel
  (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``) hands every block's backward
  the rng tensors of one forward call; with ``dropout_p = 0`` they are not read, and we do the same. The
  CUDA kernel takes fp16/bf16 only, head dims up to 256 (we ask a multiple of 8, as SDPA's dispatcher
  does without padding), on sm80 or newer. The CUDA branch is not run in CI (no GPU there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.sequence.blockwise import _expand_kv, _fold_kv

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FusedBlock:
    """The visible part of a block pair as one kernel call: queries ``rows:`` (those before see no key of
    the block) against keys ``:keys``, all visible or (``causal``) causal on the diagonal. A causal block
    is square, so the kernels' corner conventions for ``Sq != Sk`` (top-left on CPU, bottom-right in
    flash-attn 2) never matter."""

    rows: int
    keys: int
    causal: bool


def kernel_takes(q: Tensor) -> bool:
    """Whether the fused kernel of ``q``'s device accepts its dtype and head dim; never when the user switched
    flash SDPA off (``torch.backends.cuda.enable_flash_sdp(False)``, which SDPA obeys on CPU too)."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    if q.device.type == "cpu":
        return q.dtype in _CPU_DTYPES
    if q.device.type == "cuda":
        return (q.dtype in _CUDA_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
                and torch.cuda.get_device_capability(q.device) >= (8, 0))
    return False


def plan(q_host: Tensor, k_host: Tensor, causal: bool, has_doc: bool, q: Tensor) -> Optional[FusedBlock]:
    """How one block pair runs through the fused kernel, or None for the plain path. ``q_host``/``k_host``
    are the global positions (host, int64) of the queries and keys. With ascending positions the keys a
    causal query sees are a prefix of the block (``seen[i]`` of them), non-decreasing down the rows, so
    the pair is a rectangle when ``seen`` is one count after its leading zeros, and causal on the diagonal
    when it counts 1, 2, ... (the same positions on both sides: a rank's own block). The zigzag and
    contiguous layouts without document masks give only these shapes (layout.py)."""
    if has_doc or not kernel_takes(q):
        return None
    if not causal:
        return FusedBlock(0, len(k_host), False)
    if not (_ascending(q_host) and _ascending(k_host)):
        return None
    seen = torch.searchsorted(k_host, q_host, right=True)
    rows = int((seen == 0).sum())
    tail = seen[rows:]
    if rows == len(seen):
        return None  # nothing visible: ring.py skips such pairs before asking
    if bool((tail == tail[0]).all()):
        return FusedBlock(rows, int(tail[0]), False)
    if torch.equal(tail, torch.arange(1, len(tail) + 1)):
        return FusedBlock(rows, len(tail), True)
    return None


def _ascending(pos: Tensor) -> bool:
    return bool((pos[1:] > pos[:-1]).all())


def forward(q: Tensor, k: Tensor, v: Tensor, block: FusedBlock, scale: float) -> tuple[Tensor, Tensor, Any]:
    """``(o_b, lse_b, rng)`` of queries ``block.rows:`` over keys ``:block.keys``: ``o_b`` and ``lse_b`` in
    fp32 for blockwise.merge, ``rng`` the CUDA kernel's rng tensors for :func:`backward` (None on CPU)."""
    qs = q[:, :, block.rows:]
    ks, vs = (_expand_kv(t[:, :, :block.keys], q.shape[1]) for t in (k, v))
    if q.device.type == "cuda":
        o, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            qs, ks, vs, 0.0, block.causal, False, scale=scale)
        return o.float(), lse.float(), (cum_q, cum_k, seed, offset)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, block.causal, scale=scale)
    return o.float(), lse.float(), None


def backward(q: Tensor, k: Tensor, v: Tensor, block: FusedBlock, scale: float, dout: Tensor, out: Tensor,
             lse: Tensor, rng: Any) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(dq, dk, dv)`` of the block's share: ``dq`` for queries ``block.rows:``, ``dk``/``dv`` for keys
    ``:block.keys`` with the key/value heads' shape. ``out`` (in ``q``'s dtype) and ``lse`` (fp32) are the
    *merged* results over every block (ring.py [Note: fused blocks])."""
    r = block.rows
    qs, dos, os_ = q[:, :, r:], dout[:, :, r:], out[:, :, r:]
    ls = lse[:, :, r:].contiguous()
    ks, vs = (_expand_kv(t[:, :, :block.keys], q.shape[1]) for t in (k, v))
    if q.device.type == "cuda":
        cum_q, cum_k, seed, offset = rng
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dos, qs, ks, vs, os_, ls, cum_q, cum_k, qs.shape[2], ks.shape[2], 0.0, block.causal, seed, offset,
            scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dos, qs, ks, vs, os_, ls, 0.0, block.causal, scale=scale)
    return dq.float(), _fold_kv(dk.float(), k.shape[1]), _fold_kv(dv.float(), v.shape[1])
