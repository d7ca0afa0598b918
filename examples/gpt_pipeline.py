"""The example GPT as pipeline stages: :func:`gpt_pipeline`, the layers of :class:`gpt.GPT` as a
:class:`lightning_zero.pipeline.PipelineModule`, and :func:`convert_gpt_state_dict` between the two forms.

``GPTModule(pipeline=True)`` trains this form (``strategy=pipeline``; ``examples/train.py`` picks the form
from the strategy). A PipelineModule also runs its layers in sequence under the other strategies, but
there it would only hide the model from Lightning's summary (a ``PipelineModule`` of 0 FLOPs), so it is
not the default. Checkpoints of either form load into either (:func:`convert_gpt_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

if __package__:  # imported as examples.gpt_pipeline: [Note: one example, two import roots] (gpt.py)
    from .gpt import INIT_STD, Block, GPTConfig, lm_loss
else:  # examples/ on sys.path (examples/train.py)
    from gpt import INIT_STD, Block, GPTConfig, lm_loss


class Embeddings(nn.Module):
    """Token + position embedding, the first layer of :func:`gpt_layer_specs`.

    Called as ``emb(h, head=True)`` it is the tied output head ``h @ wte.weight.T``: the head goes
    through the module's ``__call__`` (not ``F.linear(h, emb.wte.weight)`` from outside) so that
    whatever hooks a strategy puts on the module (ZeRO-3 gathers a unit's parameters in its forward
    pre-hook) see both uses.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, mean=0.0, std=INIT_STD)

    def forward(self, x: Tensor, head: bool = False) -> Tensor:
        """Token ids (batch, time) -> embeddings; with ``head=True`` hidden states -> logits."""
        if head:
            return F.linear(x, self.wte.weight)
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"Sequence of length {t} exceeds the model's seq_len {self.seq_len}.")
        return self.drop(self.wte(x) + self.wpe(torch.arange(t, device=x.device)))


class LMHead(nn.Linear):
    """The untied output head (``tie_weights=False``), GPT-2 initialised."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, cfg.vocab_size, bias=False)

    @override
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


def tied_lm_head(embeddings: nn.Module, h: Tensor) -> Tensor:
    """``forward_fn`` of the head position: the tied embedding module used as the output projection."""
    return embeddings(h, head=True)


TIED_KEY = "embed"
"""Tie key of the embedding/head module: its parameters are ``tied.embed.*`` in the PipelineModule."""


def gpt_layer_specs(cfg: GPTConfig) -> list[LayerSpec]:
    """:class:`GPT` as a flat layer list: embedding, ``n_layer`` blocks, final LayerNorm, head.

    Position ``0`` is the embedding, ``1..n_layer`` the blocks, ``n_layer + 1`` the final LayerNorm and
    ``n_layer + 2`` the head: with tied weights the embedding module again (one
    :class:`~lightning_zero.pipeline.TiedLayerSpec` key, so under pipeline stages the first and last
    stage each hold a copy and their gradients are summed), untied an :class:`LMHead`.
    """
    blocks = [LayerSpec(Block, cfg) for _ in range(cfg.n_layer)]
    final_norm = LayerSpec(nn.LayerNorm, cfg.d_model, bias=cfg.bias)
    if cfg.tie_weights:
        return [
            TiedLayerSpec(TIED_KEY, Embeddings, cfg), *blocks, final_norm,
            TiedLayerSpec(TIED_KEY, Embeddings, cfg, forward_fn=tied_lm_head),
        ]
    return [LayerSpec(Embeddings, cfg), *blocks, final_norm, LayerSpec(LMHead, cfg)]


def gpt_pipeline(cfg: GPTConfig, partition: Any = "parameters") -> PipelineModule:
    """:class:`GPT` as a :class:`~lightning_zero.pipeline.PipelineModule` returning the LM loss.

    ``pipe((idx, targets))`` is the loss, ``pipe.predict(idx)`` the logits. ``partition`` splits the
    layers into stages (default: balanced parameter counts, the tied embedding counted at both ends,
    which for GPT shapes roughly balances compute too). Activation checkpointing recomputes every
    layer (``activation_checkpoint_interval=1``).
    """
    return PipelineModule(
        gpt_layer_specs(cfg), lm_loss, partition=partition,
        activation_checkpoint_interval=1 if cfg.activation_checkpointing else 0,
    )


def _module_renames(cfg: GPTConfig) -> list[tuple[str, str]]:
    """(name in :class:`GPT`, name in :func:`gpt_pipeline`) of every module holding parameters."""
    n = cfg.n_layer
    emb = f"tied.{TIED_KEY}" if cfg.tie_weights else "layers.0"
    pairs = [("wte", f"{emb}.wte"), ("wpe", f"{emb}.wpe"), ("ln_f", f"layers.{n + 1}")]
    pairs += [(f"blocks.{i}", f"layers.{i + 1}") for i in range(n)]
    if not cfg.tie_weights:
        pairs.append(("lm_head", f"layers.{n + 2}"))
    return pairs


def convert_gpt_state_dict(
    state: Mapping[str, Any], cfg: GPTConfig, to_pipeline: bool, prefix: str = "model."
) -> dict[str, Any]:
    """Rename the keys of a :class:`GPT` state dict to :func:`gpt_pipeline`'s (``to_pipeline=True``) or
    back. Keys under ``prefix`` that already have the target form, and all other keys, are kept."""
    pairs = _module_renames(cfg)
    if not to_pipeline:
        pairs = [(b, a) for a, b in pairs]
    out: dict[str, Any] = {}
    for key, value in state.items():
        new = key
        if key.startswith(prefix):
            rest = key[len(prefix):]
            for src, dst in pairs:
                if rest.startswith(src + "."):
                    new = prefix + dst + rest[len(src):]
                    break
        out[new] = value
    return out


__all__ = ["Embeddings", "LMHead", "TIED_KEY", "tied_lm_head", "gpt_layer_specs", "gpt_pipeline", "convert_gpt_state_dict"]
