"""Preallocated (static) KV caches for the compiled decode step (compiled.py): HF's ``StaticCache`` built for
the installed transformers, and :class:`StaticHookKVCache` for models that attend through our hook.

[Note: a static cache through the hook]
A CUDA graph replays fixed addresses and shapes, so the cache of a compiled step cannot grow by
``torch.cat`` as kv_cache.py's does. :class:`StaticHookKVCache` gives each module that attends through the
hook (sequence/hook.py [Note: the attention hook]) buffers ``[B, H_kv, max_len, D]`` allocated at the
prompt's forward; every forward writes its keys and values at the positions in ``state.positions`` (a
device tensor: the step reads it, the loop advances it in place, nothing is a Python int) and attends
over the whole buffer with a mask that hides the positions not yet written. The prompt's forward
attends over its own keys with ``is_causal=True`` as the plain model does, so the prompt's logits are
the plain model's bit for bit.
"""

from __future__ import annotations

import inspect
from types import TracebackType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.sequence.context import ATTRIBUTE


def hf_static_cache(model: nn.Module, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> Any:
    """HF's ``StaticCache`` for ``model`` holding ``max_len`` tokens of ``batch`` rows, whichever of its
    constructors the installed transformers has (< 4.56 takes batch, device and dtype up front; later
    versions allocate lazily at the first update)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": max_len}
    size = next((name for name in ("max_batch_size", "batch_size") if name in params), None)  # one, not both
    for name, value in ((size, batch), ("device", device), ("dtype", dtype)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


class _StaticState:
    """Shared by the layers: the positions of the current forward's tokens (a device tensor) and whether it
    is the prompt's forward."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.positions: Optional[Tensor] = None
        self.prefill = True


class _StaticLayerKV:
    """One module's key/value buffers; answers the hook's two calls ([Note: a static cache through the hook])."""

    def __init__(self, state: _StaticState) -> None:
        self.state = state
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def positions(self) -> Tensor:
        assert self.state.positions is not None, "StaticHookKVCache.prefill/decode sets the positions first"
        return self.state.positions

    def _buffers(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        shape_k = (k.shape[0], k.shape[1], self.state.max_len, k.shape[3])
        shape_v = (v.shape[0], v.shape[1], self.state.max_len, v.shape[3])
        if self.k is None or self.v is None or self.k.shape != shape_k or self.k.dtype != k.dtype \
                or self.k.device != k.device:
            self.k = torch.zeros(shape_k, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape_v, dtype=v.dtype, device=v.device)
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)
        return self.k, self.v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None) -> Tensor:
        if not causal:
            raise ValueError("StaticHookKVCache decodes causal attention only")
        pos = self.positions()
        gqa = k.shape[1] != q.shape[1]
        if self.state.prefill:  # allocate at the prompt (eager), then attend as the plain model does
            keys, values = self._buffers(k, v)
            keys.index_copy_(2, pos, k)
            values.index_copy_(2, pos, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=gqa)
        assert self.k is not None and self.v is not None
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        visible = torch.arange(self.state.max_len, device=q.device)[None, :] <= pos[:, None]  # [t, max_len]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=visible, scale=scale, enable_gqa=gqa)


class StaticHookKVCache:
    """``with cache:`` every module of ``model`` carries its static layer cache ([Note: a static
    cache through the hook]); the same layer objects are attached on every entry, so a compiled step traced
    once stays valid across generations."""

    def __init__(self, model: nn.Module, max_len: int) -> None:
        self.model = model
        self.state = _StaticState(max_len)
        self._layers = {name: _StaticLayerKV(self.state) for name, _ in model.named_modules()}

    @property
    def max_len(self) -> int:
        return self.state.max_len

    def __enter__(self) -> "StaticHookKVCache":
        attached = []
        for name, m in self.model.named_modules():
            if getattr(m, ATTRIBUTE, None) is not None:
                for done in attached:
                    delattr(done, ATTRIBUTE)
                raise ValueError(f"{type(m).__name__} carries a sequence-parallel context: generation under "
                                 "sequence_parallel is not built yet")
            setattr(m, ATTRIBUTE, self._layers[name])
            attached.append(m)
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        for m in self.model.modules():
            if ATTRIBUTE in m.__dict__:
                delattr(m, ATTRIBUTE)

    def start(self, prompt_len: int, device: torch.device) -> None:
        """The next forward is the prompt's ``prompt_len`` tokens."""
        self.state.prefill = True
        self.state.positions = torch.arange(prompt_len, device=device)

    def decode_from(self, position: Tensor) -> None:
        """Later forwards are one token each at ``position`` (a one-element device tensor advanced in place)."""
        self.state.prefill = False
        self.state.positions = position

    @property
    def used(self) -> bool:
        """Whether the prompt's forward attended through the hook (so the buffers hold its keys)."""
        return any(layer.k is not None for layer in self._layers.values())
