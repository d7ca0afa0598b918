"""``generate``: KV-cached decoding of a causal LM under any ZeRO stage, called inside ``predict_step``.

[Note: decoding under stage 3]
Under stage 3 every forward gathers each unit's weights before it runs and releases them after
(zero/stage3.py), so ``generate`` needs nothing from the strategy: each decoding step is one forward,
and the unit hooks stream the weights (from host memory or NVMe under ZeRO-Inference,
inference/engine.py). Gathers are collectives, so every rank must run the same number of forwards:
without ``eos_token_id`` each runs exactly ``max_new_tokens``; with it, the ranks agree after every
token (one all-reduce of a flag, comm/collectives.py) and stop only when every rank's sequences have
all ended, as HF's ``synced_gpus`` does; a finished sequence is padded with ``pad_token_id``. Whether to
agree (``synced_ranks``) is decided by default from the model: distributed, and some parameter released
between forwards (stage 3 gathers it in the next one); stages 0-2 decode each rank on its own.

Two kinds of models:

* HF causal LMs (``transformers.PreTrainedModel`` with ``prepare_inputs_for_generation``): their own
  cache (``DynamicCache``), ``past_key_values`` and ``use_cache``; the tokens equal HF's greedy
  ``generate`` (``do_sample=False``).
* Any other module mapping token ids ``[B, T]`` to logits ``[B, T, V]`` (or an output with ``.logits``):
  cached through the attention/positions hook when the model calls it (kv_cache.py [Note: a KV cache
  through the hook]; examples/gpt.py does), otherwise recomputed over the whole sequence per token.

Prompts of different lengths in one batch: left-padded, with an ``attention_mask``, for HF models (as HF's
``generate`` takes them); other models take prompts of equal lengths.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.config.decode import DecodeConfig
from lightning_zero.inference.compiled import decoder_for
from lightning_zero.inference.kv_cache import HookKVCache


def is_hf_causal_lm(module: nn.Module) -> bool:
    return hasattr(module, "prepare_inputs_for_generation") and hasattr(module, "config")


def _logits(output: Any) -> Tensor:
    logits = getattr(output, "logits", output)
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise TypeError(f"generate needs a model returning logits [batch, time, vocab] (or an output with "
                        f".logits), got {type(output).__name__}")
    return logits


def next_token(logits: Tensor, do_sample: bool, temperature: float, top_k: Optional[int],
               generator: Optional[torch.Generator]) -> Tensor:
    """The next token of each row from its last-position logits ``[B, V]``: argmax, or a sample of
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest (drawn from ``generator``)."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def _all_done(done: bool, device: torch.device, synced: bool) -> bool:
    """Whether this rank (``synced``: every rank) has finished ([Note: decoding under stage 3])."""
    if not synced or not C.is_initialized() or C.world_size() == 1:
        return done
    flag = torch.tensor([0.0 if done else 1.0], device=C.device_for(None, device))
    C.all_reduce(flag, None, "max")
    return bool(flag.item() == 0.0)


@torch.no_grad()
def generate(module: nn.Module, input_ids: Tensor, max_new_tokens: int, *, use_cache: bool = True,
             eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None, do_sample: bool = False,
             temperature: float = 1.0, top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             attention_mask: Optional[Tensor] = None, synced_ranks: Optional[bool] = None,
             compile: Union[bool, DecodeConfig] = False) -> Tensor:
    """``input_ids`` ``[B, T]`` followed by up to ``max_new_tokens`` generated tokens ``[B, T + n]``.

    Greedy by default (the tokens of HF's ``generate(do_sample=False)``); ``do_sample=True`` samples with
    ``temperature`` and ``top_k`` from ``generator``. ``eos_token_id``: a row that produced it is padded
    with ``pad_token_id`` (default: the eos id) from then on, and generation stops once every row of every
    rank has ended ([Note: decoding under stage 3]). ``attention_mask`` ``[B, T]`` (HF models): 0 marks the
    left padding of prompts shorter than the batch's, positions counted as HF's ``generate`` counts them.
    ``synced_ranks``: stop together across ranks (default: under stage 3, see [Note: decoding under stage
    3]). Call it on every rank under stage 3. ``compile``: True (or a :class:`DecodeConfig`) decodes with a
    static KV cache and a compiled one-token step, CUDA graphs on CUDA (compiled.py [Note: what the compiled
    step leaves out]); the same tokens."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    pick = lambda logits: next_token(logits, do_sample, temperature, top_k, generator)  # noqa: E731
    synced = _partitioned(module) if synced_ranks is None else synced_ranks
    decode = lambda forward: _decode(forward, input_ids, max_new_tokens, pick, eos_token_id, pad_token_id,  # noqa: E731
                                     synced)
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    if compile is not False:
        return _compiled(module, input_ids, max_new_tokens, compile, use_cache, attention_mask,
                         None if not do_sample else pick, eos_token_id, pad_token_id, synced)
    if is_hf_causal_lm(module):
        return decode(_hf_forward(module, use_cache, attention_mask))
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"generate: padded prompts (attention_mask with zeros) are supported for HF causal LMs only; "
                         f"{type(module).__name__} takes prompts of equal lengths")
    if not use_cache:
        return decode(_recompute_forward(module))
    with HookKVCache(module) as cache:
        return decode(_hook_forward(module, cache))


def _compiled(module: nn.Module, input_ids: Tensor, max_new_tokens: int, compile: Union[bool, DecodeConfig],
              use_cache: bool, attention_mask: Optional[Tensor], pick: Optional[Callable[[Tensor], Tensor]],
              eos_token_id: Optional[int], pad_token_id: Optional[int], synced: bool) -> Tensor:
    """``generate(compile=...)``: the compiled decoder kept on the module (compiled.py), after its refusals."""
    config = DecodeConfig() if compile is True else compile
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"compile must be True, False or a DecodeConfig, got {compile!r}")
    if not use_cache:
        raise ValueError("generate(compile=True) decodes with a static KV cache: use_cache=False contradicts it")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("generate(compile=True) takes prompts of equal lengths (no padding in attention_mask): "
                         "decode padded prompts with compile=False")
    decoder = decoder_for(module, config, is_hf_causal_lm(module))
    return decoder.generate(input_ids, max_new_tokens, pick, eos_token_id, pad_token_id,
                            lambda done: _all_done(done, input_ids.device, synced),
                            lambda length: _longest(length, input_ids.device, synced))


def _longest(length: int, device: torch.device, synced: bool) -> int:
    """The largest of the ranks' ``length`` (``synced``: they stopped together, so each returns that many
    tokens, padded as the uncompiled loop pads them), else this rank's."""
    if not synced or not C.is_initialized() or C.world_size() == 1:
        return length
    value = torch.tensor([float(length)], device=C.device_for(None, device))
    C.all_reduce(value, None, "max")
    return int(value.item())


def _partitioned(module: nn.Module) -> bool:
    """Distributed, and some parameter of ``module`` released (storage emptied by a stage-3 engine between
    its unit's forwards): its forwards gather, so every rank must run as many ([Note: decoding under stage 3])."""
    if not C.is_initialized() or C.world_size() == 1:
        return False
    return any(p.numel() and not p.is_meta and p.untyped_storage().nbytes() == 0 for p in module.parameters())


Forward = Callable[[Tensor, Tensor], Tensor]
"""(all tokens so far, tokens new since the last call) -> last-position logits ``[B, V]``."""


def _decode(forward: Forward, input_ids: Tensor, max_new_tokens: int, pick: Callable[[Tensor], Tensor],
            eos_token_id: Optional[int], pad_token_id: Optional[int], synced: bool) -> Tensor:
    ids = input_ids
    new = input_ids
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    pad = pad_token_id if pad_token_id is not None else eos_token_id
    for _ in range(max_new_tokens):
        token = pick(forward(ids, new)).to(ids.dtype)
        if eos_token_id is not None:
            token = torch.where(unfinished, token, torch.full_like(token, pad))  # type: ignore[arg-type]
            unfinished &= token != eos_token_id
        new = token[:, None]
        ids = torch.cat([ids, new], dim=1)
        if eos_token_id is not None and _all_done(not bool(unfinished.any()), ids.device, synced):
            break
    return ids


def _hf_forward(model: nn.Module, use_cache: bool, mask: Optional[Tensor]) -> Forward:
    """HF's cache (or none); with a padding ``mask``, the mask grown by each new token and the positions HF's
    ``generate`` uses (``cumsum(mask) - 1``, padding at 0)."""
    masks = [mask]

    def padding(ids: Tensor, new: Tensor) -> dict[str, Tensor]:
        m = masks[0]
        if m is None:
            return {}
        if m.shape[1] < ids.shape[1]:
            m = torch.cat([m, m.new_ones(m.shape[0], ids.shape[1] - m.shape[1])], dim=1)
            masks[0] = m
        pos = (m.long().cumsum(-1) - 1).masked_fill(m == 0, 0)
        return {"attention_mask": m, "position_ids": pos[:, -new.shape[1]:] if use_cache else pos}

    if not use_cache:
        return lambda ids, new: _logits(model(input_ids=ids, use_cache=False, **padding(ids, ids)))[:, -1]
    from transformers import DynamicCache

    cache = DynamicCache()
    # transformers >= 5.x names the argument ``cache`` (``past_key_values`` is deprecated there)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(ids: Tensor, new: Tensor) -> Tensor:
        return _logits(model(input_ids=new, use_cache=True, **{key: cache}, **padding(ids, new)))[:, -1]

    return forward


def _recompute_forward(model: nn.Module) -> Forward:
    return lambda ids, new: _logits(model(ids))[:, -1]


def _hook_forward(model: nn.Module, cache: HookKVCache) -> Forward:
    """Cached through the hook; a model that never calls it (``cache.used`` false after the prompt)
    recomputes the whole sequence from then on ([Note: a KV cache through the hook])."""

    def forward(ids: Tensor, new: Tensor) -> Tensor:
        if cache.state.length and not cache.used:  # the prompt ran without the hook: no cache to extend
            return _logits(model(ids))[:, -1]
        cache.step(new.shape[1])
        return _logits(model(new))[:, -1]

    return forward
