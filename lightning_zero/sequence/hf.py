"""HF transformers models under sequence parallelism, unmodified: an attention function registered in HF's
attention registry (``AttentionInterface``) and selected through the model's ``attn_implementation``.

[Note: HF models through the registry]
HF models call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, attention_mask, ...)``
with ``q, k, v`` as ``[B, H, S, D]`` after rotary embeddings, and expect ``[B, S, H, D]`` back. Registering
``lightning_zero_sp`` there and switching the model to it is all a model needs: rotary embeddings already
used the global ``position_ids`` the batch splitter passes, and an implementation HF has no mask function
for makes HF skip building a mask (we build ours from positions and document ids). What we cannot honour
is refused on the first call, naming the module: a padding ``attention_mask`` (pack sequences instead),
attention dropout while training, sliding windows shorter than the sequence (one that covers it
changes nothing), soft-capping and ``output_attentions``.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from lightning_zero.sequence.context import SequenceContext, attach, context_of

ATTN_NAME = "lightning_zero_sp"


def sequence_parallel_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Optional[Tensor], dropout: float = 0.0,
                                scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                                **kwargs: Any) -> tuple[Tensor, None]:
    """HF's attention-function signature over the sequence-parallel group (see [Note: HF models through
    the registry])."""
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"{name}: sequence parallelism does not take a padding attention_mask; pack the "
                         "sequences (position_ids restarting at 0 per document) instead")
    if dropout and module.training:
        raise ValueError(f"{name}: attention dropout ({dropout}) is not supported under sequence parallelism")
    context = context_of(module)
    window = kwargs.get("sliding_window")
    if window is not None and window < context.layout.seq_len:  # a window covering the sequence changes nothing
        raise ValueError(f"{name}: sliding-window attention ({window} tokens) is not supported under sequence "
                         f"parallelism (sequence of {context.layout.seq_len})")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{name}: attention soft-capping is not supported under sequence parallelism")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{name}: output_attentions is not available under sequence parallelism")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = context.attend(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="lightning_zero_sp"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, sequence_parallel_attention)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules HF calls the attention function with: those holding the q/k/v projections of a layer
    (class names ending in ``Attention`` that own a ``config``-style ``head_dim``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "head_dim")]


def prepare_hf(model: nn.Module, context: SequenceContext) -> None:
    """Switch an HF ``PreTrainedModel`` to the sequence-parallel attention; refuse a model it cannot split.
    A sliding window is judged at the first call, against the sequence it is given (the length is unknown
    here: the strategy prepares the model before its first batch)."""
    config = getattr(model, "config", None)
    modules = attention_modules(model)
    if config is None or not modules:
        raise ValueError(f"{type(model).__name__}: no HF attention modules found to split the sequence over")
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:  # older transformers
        config._attn_implementation = ATTN_NAME
    attach(modules, context)

