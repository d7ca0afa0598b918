"""A KV cache for models that are not HF transformers, through the attention/positions hook.

[Note: a KV cache through the hook]
Models that call ``lightning_zero.sequence.attention(self, q, k, v, is_causal=True)`` and
``lightning_zero.sequence.positions(self, t, device)`` (sequence/hook.py [Note: the attention hook]; our
example GPT does) hand every attention and every position numbering to whatever context the module
carries. :class:`HookKVCache` attaches one such context per module for the duration of a generation:
``positions`` returns the positions after the tokens already cached, and ``attend`` appends this
forward's keys and values to the module's cache and attends over all of them (the queries of ``t`` new
tokens see every cached key and the new keys up to their own). The model's code is unchanged: without
the cache attached the two calls are the plain torch calls. A model that never calls the hook leaves
the cache empty (``calls == 0`` after the prefill): :func:`~lightning_zero.inference.generate` then
decodes without a cache, recomputing the whole sequence per token.

The first forward (the prompt, nothing cached) attends with ``is_causal=True`` exactly as the plain
model does; later ones pass an explicit mask only when several new tokens come at once.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.sequence.context import ATTRIBUTE


class _DecodeState:
    """Shared by the layers' caches: tokens cached so far and tokens in the current forward."""

    def __init__(self) -> None:
        self.offset = 0
        self.length = 0
        self.calls = 0


class _LayerKV:
    """One module's cached keys and values ``[B, H_kv, S, D]``; answers the hook's two calls."""

    def __init__(self, state: _DecodeState) -> None:
        self.state = state
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def positions(self) -> Tensor:
        s = self.state
        return torch.arange(s.offset, s.offset + s.length)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None) -> Tensor:
        self.state.calls += 1
        if self.k is not None and self.v is not None:
            k = torch.cat([self.k, k], dim=2)
            v = torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        t, total = q.shape[2], k.shape[2]
        gqa = k.shape[1] != q.shape[1]
        if total == t or not causal:  # the prompt (or non-causal attention): the plain call
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal and t > 1, scale=scale, enable_gqa=gqa)
        mask = None
        if t > 1:  # new token i sees every cached key and the new ones up to itself
            mask = torch.ones(t, total, dtype=torch.bool, device=q.device).tril(diagonal=total - t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class HookKVCache:
    """``with HookKVCache(model) as cache:`` every module of ``model`` carries a cache context
    ([Note: a KV cache through the hook]); before each forward call :meth:`step` with its token count."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state = _DecodeState()
        self._modules: list[nn.Module] = []

    def __enter__(self) -> "HookKVCache":
        for m in self.model.modules():
            if getattr(m, ATTRIBUTE, None) is not None:
                self.__exit__(None, None, None)
                raise ValueError(f"{type(m).__name__} carries a sequence-parallel context: generation under "
                                 "sequence_parallel is not built yet")
            setattr(m, ATTRIBUTE, _LayerKV(self.state))
            self._modules.append(m)
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        for m in self._modules:
            if ATTRIBUTE in m.__dict__:
                delattr(m, ATTRIBUTE)
        self._modules = []

    def step(self, new_tokens: int) -> None:
        """The next forward brings ``new_tokens`` tokens (call before it); the previous ones are cached."""
        self.state.offset += self.state.length
        self.state.length = new_tokens

    @property
    def used(self) -> bool:
        """Whether the model attended through the hook (so the cache holds its keys and values)."""
        return self.state.calls > 0
