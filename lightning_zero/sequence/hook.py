"""The hook for models that are not HF transformers (our example GPT, nanoGPT-style code): two calls that
behave as plain torch without sequence parallelism and split the sequence with it.

[Note: the attention hook]
A model opts in by calling, in place of ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``::

    y = lightning_zero.sequence.attention(self, q, k, v, is_causal=True)

and, where it numbers its tokens (learned or rotary position embeddings), in place of
``torch.arange(t, device=x.device)``::

    pos = lightning_zero.sequence.positions(self, t, x.device)

Without ``sequence_parallel`` both are exactly the torch calls they replace. With it, the strategy has
attached the group's context to every module of the LightningModule (context.py), so ``attention`` runs
Ulysses or ring attention over the group and ``positions`` returns the global positions of this rank's
tokens. The batch is split by the strategy as for HF models (apply.py): the training step reads
``batch["input_ids"]``, ``batch["shift_labels"]`` and divides its summed token loss by
``batch["num_items_in_batch"]`` (or calls :func:`lightning_zero.sequence.batch.sequence_loss`). A model
that never calls ``attention`` would attend within its slice only: the first training step that runs no
attention through the hook stops the run before its backward (apply.py ``check_attention_ran``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.sequence.context import ATTRIBUTE


def attention(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True,
              scale: Optional[float] = None, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` over the sequence-parallel group when ``module`` has a context
    (``[B, H, S_local, D]``), the torch call itself otherwise (see [Note: the attention hook])."""
    context = getattr(module, ATTRIBUTE, None)
    if context is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if dropout_p and module.training:
        raise ValueError(f"{type(module).__name__}: attention dropout ({dropout_p}) is not supported under "
                         "sequence parallelism")
    return context.attend(q, k, v, causal=is_causal, scale=scale)


def positions(module: nn.Module, length: int, device: torch.device) -> Tensor:
    """The global positions of this rank's ``length`` tokens (``torch.arange(length)`` without sequence
    parallelism)."""
    context = getattr(module, ATTRIBUTE, None)
    if context is None:
        return torch.arange(length, device=device)
    pos = context.positions()
    if pos.numel() != length:
        raise ValueError(f"{type(module).__name__}: {length} tokens, but this rank holds {pos.numel()} of the "
                         "sequence: pass the batch's input_ids as split by the strategy")
    return pos.to(device, non_blocking=True)
