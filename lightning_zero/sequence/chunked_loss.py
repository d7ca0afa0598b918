"""Cross-entropy over a large vocabulary without the ``[tokens, vocab]`` logits: the output projection and
the loss computed chunk by chunk, recomputed in the backward.

[Note: the chunked loss]
At long sequence the logits dominate activation memory: 128K tokens x a 128K vocabulary is 64 GB in fp32
(the loss upcasts), more than the model. ``chunked_cross_entropy(hidden, weight, labels)`` computes, for
each chunk of ``chunk_tokens`` tokens, ``logits = hidden_c @ weight.T`` in fp32, the chunk's summed loss and
nothing else; the backward recomputes each chunk's logits and turns them into gradients at once
(``softmax - onehot``, scaled by the incoming gradient), adding ``dW += g^T hidden_c`` and writing
``dhidden_c = g W``. Peak extra memory is one chunk's logits; the price is the projection computed twice
(DeepSpeed ALST's tiled loss and Liger's fused linear cross-entropy make the same trade). Returns the sum
over tokens whose label is not ``ignore_index`` (the caller divides by the global count: batch.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100

# [Note: no host reads, 16-bit GEMMs]
# The backward subtracts the one-hot of each kept label with a scatter (ignored rows add 0 at index 0 and are
# then zeroed): boolean-mask indexing would read the mask's count on the host, a device synchronisation per
# chunk. Both gradient GEMMs run in the dtype the forward's ``F.linear`` ran in (autocast's under a mixed
# precision, as an ``nn.Linear`` head's backward does: ddp's bf16-mixed run computes the head's weight gradient
# in one bf16 GEMM); each chunk's product is added to the fp32 ``dweight``. In fp32 runs nothing changes: the GEMMs stay fp32, the scatter subtracts
# exactly 1.0 where the indexing did.


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk: int,
                ignore_index: int) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for sl in _chunks(hidden.shape[0], chunk):
            logits = F.linear(hidden[sl], weight, bias).float()
            total += F.cross_entropy(logits, labels[sl], ignore_index=ignore_index, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        kind = hidden.device.type
        ctx.gemm_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) \
            else torch.promote_types(hidden.dtype, weight.dtype)  # the dtype the forward's F.linear ran in
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        dbias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if bias is not None else None
        gd = ctx.gemm_dtype
        w, b = weight.to(gd), (bias.to(gd) if bias is not None else None)  # the forward's operands (autocast's)
        for sl in _chunks(hidden.shape[0], ctx.chunk):
            logits = F.linear(hidden[sl].to(gd), w, b).float()
            g = torch.softmax(logits, dim=-1)
            lab = labels[sl]
            keep = (lab != ctx.ignore_index).to(g.dtype).unsqueeze(-1)
            g.scatter_add_(1, lab.clamp_min(0).unsqueeze(-1), -keep)  # see [Note: no host reads, 16-bit GEMMs]
            g *= keep * grad
            g16 = g.to(gd)
            dhidden[sl] = (g16 @ w).to(hidden.dtype)
            dweight += (g16.transpose(0, 1) @ hidden[sl].to(gd)).float()
            if dbias is not None:
                dbias += g.sum(0)
        return (dhidden, dweight.to(weight.dtype), dbias.to(bias.dtype) if dbias is not None else None,
                None, None, None)


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None,
                          chunk_tokens: int = 4096, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Summed cross-entropy of ``F.linear(hidden, weight, bias)`` against ``labels`` (see [Note: the chunked
    loss]); ``hidden`` ``[..., D]`` and ``labels`` ``[...]`` are flattened over tokens."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedCrossEntropy.apply(flat, weight, bias, labels.reshape(-1), chunk_tokens, ignore_index)
