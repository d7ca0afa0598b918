"""Compiled decoding: a static KV cache, the prompt run eagerly, the one-token step compiled (CUDA graphs on
CUDA), a loop without host syncs. ``generate(..., compile=True)`` uses it; :class:`CompiledDecoder` is the
object it keeps on the model between calls.

[Note: what the compiled step leaves out]
At batch 1 a decode step reads every weight once and does little else, so what separates a step from the
weight-bandwidth roofline is what runs between the kernels: Python per layer, one launch per op, and host
syncs. The step here is one ``torch.compile`` region holding the forward of one token, the pick of the
next (argmax on the device) and the end-of-sequence bookkeeping (``where`` and ``&`` on the device), so
under ``mode="reduce-overhead"`` a token is one CUDA graph replay plus two small copies into the output
buffer; the prompt's forward, whose shapes differ for every prompt length, runs eagerly. HF's ``generate``
with a static cache and a compiled forward runs its logits processors, stopping criteria (a host sync
per token for ``eos``) and cache bookkeeping in Python around each graph; gpt-fast's loop is the model
for this one.

[Note: a sync-free decode loop]
Nothing in the loop reads a device value on the host: the position is a device tensor advanced in place, the
tokens go into a preallocated device buffer. With ``eos_token_id`` the host learns whether every row has
ended only every ``DecodeConfig.eos_check_every`` tokens (one sync; under ``synced_ranks`` that is the
all-reduce of generate.py [Note: decoding under stage 3]), so up to that many - 1 tokens are decoded past the
end; the result is cut to the length the uncompiled loop stops at (the latest first-eos of the rows; of
every rank's rows under ``synced_ranks``), and rows that ended earlier hold ``pad_token_id`` after their
eos, as there. The tokens equal the uncompiled path's (greedy: the same argmax of the same model; the
compiled kernels may round differently from the eager ones, which only a near-tie of two logits could
expose).

[Note: CUDA graphs only on CUDA]
``mode="reduce-overhead"`` is torch.compile's CUDA graph mode. On any other device (CPU tests, CI) the step
is compiled with ``mode="default"`` instead: the same traced graph and the same static cache, without the
graph capture. Backends other than inductor take no mode.

What it refuses, each up front: weights that stage 3 releases between forwards (the gathers run in hooks
that a graph cannot replay; decode with ``compile=False`` there), padded prompts (the static cache here
numbers positions from 0 for every row), ``use_cache=False``, and models that attend neither as an HF
causal LM nor through the attention hook (no cache to make static).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_zero.config.decode import DecodeConfig
from lightning_zero.inference.static_cache import StaticHookKVCache, hf_static_cache

Pick = Callable[[Tensor], Tensor]
_STAGE3_HOOKS = "lightning_zero.zero.stage3"
_WITHOUT_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def _logits(output: Any) -> Tensor:
    return getattr(output, "logits", output)


def released(module: nn.Module) -> bool:
    """Stage 3 manages the weights: some parameter's storage emptied between forwards, or a stage-3 engine's
    gather/release hooks on a submodule (with one data-parallel rank nothing is emptied, but the hooks still
    swap storages, which a traced graph cannot)."""
    if any(p.numel() and not p.is_meta and p.untyped_storage().nbytes() == 0 for p in module.parameters()):
        return True
    for m in module.modules():
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
            if getattr(hook, "__module__", "").startswith(_STAGE3_HOOKS):
                return True
    return False


def mask_eos(token: Tensor, unfinished: Tensor, ids: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """A row already ended gets the pad id; a row producing eos ends (generate.py's ``_decode``, on the device).
    ``ids``: ``[eos, pad]`` on the device (tensors, not ints: other ids reuse the compiled step), None: no eos."""
    if ids is None:
        return token, unfinished
    token = torch.where(unfinished, token, ids[1])
    return token, unfinished & (token != ids[0])


class CompiledDecoder:
    """Decodes ``model`` (an HF causal LM or a model attending through the hook) with a static cache and a
    compiled step ([Note: what the compiled step leaves out]); keeps the cache and the compiled step across
    calls of the same batch size and cache length."""

    def __init__(self, model: nn.Module, config: DecodeConfig, hf: bool) -> None:
        self.model, self.config, self.hf = model, config, hf
        self._cache: Any = None
        self._shape: Optional[tuple] = None
        self._pos: Optional[Tensor] = None
        self._unfinished: Optional[Tensor] = None
        self._token: Optional[Tensor] = None
        self._ids: Optional[Tensor] = None
        self._step: Optional[Callable[..., Any]] = None
        self._device_type: Optional[str] = None
        if hf:
            params = inspect.signature(model.forward).parameters
            # transformers >= 5.x names the argument ``cache``; < 4.56 needs ``cache_position`` with a static cache
            self._cache_key = "cache" if "cache" in params else "past_key_values"
            self._cache_position = "cache_position" in params
            self._keep = "logits_to_keep" if "logits_to_keep" in params else None

    # -- the compiled region ---------------------------------------------------------------------------------
    def _forward(self, token: Tensor, pos: Tensor) -> Tensor:
        """Last-position logits ``[B, V]`` of ``token`` ``[B, t]`` at positions ``pos`` ``[t]``."""
        if not self.hf:
            return _logits(self.model(token))[:, -1]
        kwargs: dict[str, Any] = {self._cache_key: self._cache, "use_cache": True,
                                  "position_ids": pos[None].expand(token.shape[0], -1)}
        if self._cache_position:
            kwargs["cache_position"] = pos
        if self._keep is not None:
            kwargs[self._keep] = 1
        return _logits(self.model(input_ids=token, **kwargs))[:, -1]

    def _greedy_step(self, token: Tensor, pos: Tensor, unfinished: Tensor,
                     ids: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        nxt = self._forward(token, pos).float().argmax(dim=-1)
        return mask_eos(nxt, unfinished, ids)

    def _logits_step(self, token: Tensor, pos: Tensor) -> Tensor:
        return self._forward(token, pos).float()

    def _compiled(self, device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
        if self._step is None or self._device_type != device.type:
            cfg = self.config
            kwargs: dict[str, Any] = {"backend": cfg.backend, "fullgraph": cfg.fullgraph, "dynamic": False}
            if cfg.backend == "inductor":  # [Note: CUDA graphs only on CUDA]
                mode = cfg.mode if device.type == "cuda" else _WITHOUT_GRAPHS.get(cfg.mode, cfg.mode)
                if cfg.coordinate_descent:  # torch.compile takes a mode or options, not both: the mode's options
                    from torch._inductor import list_mode_options

                    kwargs["options"] = {**list_mode_options(mode), "coordinate_descent_tuning": True}
                else:
                    kwargs["mode"] = mode
            self._step = (torch.compile(self._greedy_step, **kwargs), torch.compile(self._logits_step, **kwargs))
            self._device_type = device.type
        return self._step

    # -- cache ----------------------------------------------------------------------------------------------
    def _prepare(self, batch: int, needed: int, device: torch.device) -> None:
        multiple = self.config.cache_multiple
        max_len = -(-needed // multiple) * multiple
        dtype = next(self.model.parameters()).dtype
        shape = (batch, max_len, device, dtype)
        if self._shape is not None and self._shape[0] == batch and self._shape[1] >= needed \
                and self._shape[2:] == shape[2:]:
            if self.hf:
                self._cache.reset()
            return
        self._cache = hf_static_cache(self.model, batch, max_len, device, dtype) if self.hf else \
            StaticHookKVCache(self.model, max_len)
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        self._unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self._token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._ids = torch.zeros(2, dtype=torch.long, device=device)
        for t in (self._pos, self._unfinished, self._token, self._ids):  # fixed addresses: no copy per replay
            torch._dynamo.mark_static_address(t)
        self._shape = shape

    def _prefill(self, input_ids: Tensor) -> Tensor:
        """The prompt's last-position logits, eagerly, filling the cache."""
        t = input_ids.shape[1]
        if self.hf:
            return self._forward(input_ids, torch.arange(t, device=input_ids.device))
        self._cache.start(t, input_ids.device)
        logits = self._forward(input_ids, torch.arange(t, device=input_ids.device))
        if not self._cache.used:
            raise ValueError(f"generate(compile=True) needs a KV cache: {type(self.model).__name__} attends neither "
                             "as an HF causal LM nor through lightning_zero.sequence.attention; use compile=False")
        assert self._pos is not None
        self._cache.decode_from(self._pos)
        return logits

    # -- the loop -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, pick: Optional[Pick], eos: Optional[int],
                 pad: Optional[int], all_done: Callable[[bool], bool],
                 longest: Callable[[int], int] = lambda length: length) -> Tensor:
        """``input_ids`` and up to ``max_new_tokens`` tokens ([Note: a sync-free decode loop]); ``pick`` None is
        greedy; ``all_done(this_rank_done)`` says whether every rank has ended, ``longest(length)`` the length
        the ranks stopping together return (generate.py)."""
        if max_new_tokens == 0:
            return input_ids
        if released(self.model):
            raise ValueError("generate(compile=True) needs the model's weights resident on its device; stage 3 "
                             "releases them between forwards (gathered by hooks a CUDA graph cannot replay): "
                             "decode with compile=False there")
        batch, t = input_ids.shape
        device = input_ids.device
        self._prepare(batch, t + max_new_tokens, device)
        greedy_step, logits_step = self._compiled(device)
        pos, unfinished, current = self._pos, self._unfinished, self._token
        assert pos is not None and unfinished is not None and current is not None
        fill = 0 if eos is None else (pad if pad is not None else eos)  # past a stop: what a finished row holds
        out = torch.full((batch, max_new_tokens), fill, dtype=torch.long, device=device)
        unfinished.fill_(True)
        with self._cache if not self.hf else contextlib.nullcontext():
            first = self._prefill(input_ids).float()
            ids = None
            if eos is not None:
                assert self._ids is not None
                self._ids.copy_(torch.tensor([eos, pad if pad is not None else eos]))
                ids = self._ids
            token, still = mask_eos((pick or _argmax)(first), unfinished, ids)
            out[:, 0] = token
            current.copy_(token[:, None])
            unfinished.copy_(still)
            pos.fill_(t)
            steps = max_new_tokens
            for i in range(1, max_new_tokens):
                if eos is not None and i % self.config.eos_check_every == 0 and all_done(not bool(unfinished.any())):
                    steps = i
                    break
                torch.compiler.cudagraph_mark_step_begin()
                if pick is None:
                    token, still = greedy_step(current, pos, unfinished, ids)
                else:
                    token, still = mask_eos(pick(logits_step(current, pos)), unfinished, ids)
                out[:, i] = token
                current.copy_(token[:, None])
                unfinished.copy_(still)
                pos.add_(1)
        length = steps if eos is None else longest(_length(out[:, :steps], eos))
        return torch.cat([input_ids, out[:, :length].to(input_ids.dtype)], dim=1)


def _argmax(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)


def _length(out: Tensor, eos: Optional[int]) -> int:
    """Tokens the uncompiled loop would have produced: all of ``out``, or up to the latest first-eos of the
    rows when every row has one."""
    if eos is None:
        return out.shape[1]
    hit = out == eos
    if not bool(hit.any(dim=1).all()):
        return out.shape[1]
    return int(hit.int().argmax(dim=1).max()) + 1


def decoder_for(model: nn.Module, config: DecodeConfig, hf: bool) -> CompiledDecoder:
    """The model's decoder for ``config``, kept on the model (``model.__dict__``, not a module or buffer) so a
    second call reuses its compiled step and cache."""
    decoder = model.__dict__.get("_lz_compiled_decoder")
    if not isinstance(decoder, CompiledDecoder) or decoder.config != config:
        decoder = CompiledDecoder(model, config, hf)
        model.__dict__["_lz_compiled_decoder"] = decoder
    return decoder
