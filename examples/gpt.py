"""A GPT-style causal language model: the example workload's network.

Small enough to train on two CPU cores (``conf/model/gpt_small.yaml``) and, unchanged, the 1.3B-parameter
benchmark model (``conf/model/gpt_1b.yaml``). It deliberately contains what stresses a ZeRO engine:
a weight shared by two uses (the tied embedding / output head), MoE layers, Progressive Layer Dropping
and optional activation checkpointing; its LightningModule adds parameter groups with different weight
decay and an LR scheduler stepped every step.

The example in three files, one concept each:

* this file: :class:`GPT`, a plain ``nn.Module`` (``blocks`` in an ``nn.ModuleList``), its layers and
  :func:`flops_per_token`; what ``ddp``/``zero0-3``, the benchmarks and Lightning's peers (FSDP,
  DeepSpeed) train;
* ``gpt_pipeline.py``: :func:`gpt_pipeline`, the same layers as a
  :class:`lightning_zero.pipeline.PipelineModule` (:func:`gpt_layer_specs`: tied embedding, blocks, final
  LayerNorm, the embedding again as the head), what ``GPTModule(pipeline=True)`` trains under
  ``strategy=pipeline`` (``examples/train.py`` picks the form from the strategy), and
  :func:`convert_gpt_state_dict` between the two forms' parameter names;
* ``gpt_module.py``: :class:`GPTModule`, the LightningModule that trains either form (optimizers, LR
  schedule, ZeRO-3's sharded initialisation hook, tensor parallelism in ``configure_model``).

Every name of the three is importable from here (``from examples.gpt import GPTModule`` or, with
``examples/`` on the path as ``examples/train.py`` has it, ``from gpt import GPTModule``): see
[Note: one example, two import roots].
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_zero import sequence
from lightning_zero.callbacks import LayerDropPlan
from lightning_zero.moe import MoE

INIT_STD = 0.02
"""GPT-2's initialisation: weights ~ N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer)."""


@dataclass
class GPTConfig:
    """Shape of the model; ``conf/model/*.yaml`` are presets of it."""

    vocab_size: int
    """Number of token ids (256 for byte-level text; 50304 = GPT-2's 50257 padded to a multiple of 64)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide d_model."""
    d_model: int
    """Residual stream width."""
    seq_len: int
    """Maximum context length (size of the learned position embedding)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and MLP outputs (0 keeps runs bit-comparable across strategies)."""
    tie_weights: bool = True
    """Share the token embedding with the output head (GPT-2 does; it is also a ZeRO edge case)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them (memory for compute)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    pld: bool = False
    """Progressive Layer Dropping (lightning_zero.callbacks.ProgressiveLayerDrop, added by GPTModule): training
    batches skip blocks on DeepSpeed's schedule, a dropped block is the identity; evaluation runs every block."""
    pld_theta: float = 0.5
    """With ``pld``: the keep ratio the schedule decays to (DeepSpeed's theta)."""
    pld_gamma: float = 0.001
    """With ``pld``: the decay rate per optimizer step (DeepSpeed's gamma)."""
    compile: bool = False
    """torch.compile each transformer block (:meth:`GPTModule.compile_network`), under any strategy."""
    compile_mode: Optional[str] = None
    """With ``compile``: torch.compile's ``mode`` (e.g. 'max-autotune-no-cudagraphs'); None is its default."""
    moe_experts: int = 0
    """Mixture of Experts (lightning_zero.moe.MoE): experts of each MoE layer; 0: every MLP is dense."""
    moe_every: int = 2
    """With ``moe_experts``: the MLP of every ``moe_every``-th block is an MoE layer of copies of it (blocks
    ``moe_every - 1``, ``2 moe_every - 1``, ...: DeepSpeed-MoE's every other layer for 2)."""
    moe_top_k: Optional[int] = None
    """MoE options: None takes :class:`lightning_zero.moe.MoE`'s default (top_k=1, capacity_factor=1,
    eval_capacity_factor=1, min_capacity=4, drop_tokens=True, aux_loss_coef=0.01)."""
    moe_capacity_factor: Optional[float] = None
    moe_eval_capacity_factor: Optional[float] = None
    moe_min_capacity: Optional[int] = None
    moe_drop_tokens: Optional[bool] = None
    moe_aux_loss_coef: Optional[float] = None

    def is_moe_block(self, i: int) -> bool:
        return self.moe_experts > 0 and (i + 1) % self.moe_every == 0

    def moe_options(self) -> dict[str, Any]:
        """The MoE arguments this config sets (the rest keep the layer's defaults)."""
        names = ("top_k", "capacity_factor", "eval_capacity_factor", "min_capacity", "drop_tokens", "aux_loss_coef")
        return {n: getattr(self, f"moe_{n}") for n in names if getattr(self, f"moe_{n}") is not None}

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model}).")
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "moe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.moe_experts < 0:
            raise ValueError(f"GPTConfig.moe_experts must be >= 0, got {self.moe_experts}.")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, through PyTorch's fused SDPA kernels."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        # F.scaled_dot_product_attention itself, or across the split under sequence_parallel (lightning_zero/sequence/hook.py)
        y = sequence.attention(self, q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    ``moe``: the MLP is a :class:`lightning_zero.moe.MoE` of ``cfg.moe_experts`` MLPs, ``ep_size`` of them
    split over the expert-parallel ranks (ZeroStrategy(expert_parallel=ep_size) hands the layer its group)."""

    def __init__(self, cfg: GPTConfig, moe: bool = False, ep_size: int = 1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp: nn.Module = (
            MoE(cfg.d_model, lambda: MLP(cfg), num_experts=cfg.moe_experts, ep_size=ep_size, **cfg.moe_options())
            if moe else MLP(cfg)
        )
        self.residual_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
        self.reset_parameters()

    def residual_projections(self) -> tuple[nn.Linear, ...]:
        """The Linear layers writing into the residual stream (GPT-2 scales their initialisation)."""
        if isinstance(self.mlp, MoE):
            return (self.attn.proj, *(e.proj for e in self.mlp.experts))
        return self.attn.proj, self.mlp.proj

    def reset_parameters(self) -> None:
        """GPT-2 initialisation of this block: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer))."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for proj in self.residual_projections():
            nn.init.normal_(proj.weight, mean=0.0, std=self.residual_std)

    def forward(self, x: Tensor, scale: Optional[float] = None) -> Tensor:
        """``scale`` (Progressive Layer Dropping, a kept block: 1 / keep probability) multiplies both
        residual branches; None leaves the block exactly as without PLD."""
        if scale is None:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x)) * scale
        return x + self.mlp(self.ln_2(x)) * scale


class GPT(nn.Module):
    """Decoder-only transformer: token + position embedding, pre-LN blocks, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig, ep_size: int = 1) -> None:
        """``ep_size``: expert-parallel degree of the MoE layers (``cfg.moe_experts``)."""
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe_block(i), ep_size) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        # Tied: the head *is* wte.weight (F.linear in forward), so the parameter exists exactly once and
        # ZeRO sees one parameter receiving gradient from two places. Untied: a separate Linear.
        self.lm_head: Optional[nn.Linear] = (
            None if cfg.tie_weights else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self._reset_outer_parameters()  # the blocks initialised themselves
        self._layer_drop: Optional[LayerDropPlan] = None

    def pld_num_layers(self) -> int:
        """Progressive Layer Dropping protocol (lightning_zero.callbacks.SupportsLayerDrop): the blocks."""
        return self.cfg.n_layer

    def set_layer_drop(self, plan: Optional[LayerDropPlan]) -> None:
        """This training batch's drop plan (None: run every block), from ProgressiveLayerDrop."""
        self._layer_drop = plan

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for block in self.blocks:
            block.reset_parameters()
        self._reset_outer_parameters()

    def _reset_outer_parameters(self) -> None:
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, mean=0.0, std=INIT_STD)
        self.ln_f.reset_parameters()
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=INIT_STD)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (batch, time) -> next-token logits (batch, time, vocab)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"Sequence of length {t} exceeds the model's seq_len {self.cfg.seq_len}.")
        pos = sequence.positions(self, t, idx.device)  # torch.arange(t), or this rank's positions under sequence_parallel
        x = self.drop(self.wte(idx) + self.wpe(pos))
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        plan = self._layer_drop if self.training else None  # evaluation runs every block
        if plan is None:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        else:  # Progressive Layer Dropping: a dropped block is the identity and costs nothing
            for i, block in enumerate(self.blocks):
                if plan.keep[i]:
                    scale = plan.scale(i)
                    x = checkpoint(block, x, scale, use_reentrant=False) if recompute else block(x, scale)
        h = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(h, self.wte.weight)
        return self.lm_head(h)


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy (mean over tokens), computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


def matmul_params(cfg: GPTConfig) -> int:
    """Parameters that take part in a matmul per token: everything except the embedding tables, plus the head.

    With tied weights the token embedding *is* the head, so it counts once; the position embedding is a
    lookup and never counts.
    """
    d = cfg.d_model
    bias = 1 if cfg.bias else 0
    per_block = (
        (3 * d * d + 3 * d * bias)  # qkv
        + (d * d + d * bias)  # attention output projection
        + (4 * d * d + 4 * d * bias)  # mlp up
        + (4 * d * d + d * bias)  # mlp down
        + 2 * (d + d * bias)  # two LayerNorms
    )
    mlp = (4 * d * d + 4 * d * bias) + (4 * d * d + d * bias)
    moe_blocks = sum(cfg.is_moe_block(i) for i in range(cfg.n_layer))
    top_k = cfg.moe_options().get("top_k", 1)
    moe_extra = moe_blocks * ((top_k - 1) * mlp + d * cfg.moe_experts)  # top_k experts per token, and the gate
    return cfg.n_layer * per_block + moe_extra + (d + d * bias) + cfg.vocab_size * d


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), as in PaLM's / nanoGPT's MFU estimate.

    6N for the parameter matmuls (2 forward, 4 backward) plus 12 * n_layer * d_model * seq_len for the
    attention score and value matmuls. Activation checkpointing's recomputation is deliberately not
    counted: MFU measures useful work.
    """
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


# [Note: one example, two import roots] The example is imported two ways: as the package ``examples``
# (``from examples.gpt import GPT``: tests, benchmarks) and as top-level modules next to the script
# (``python examples/train.py`` puts ``examples/`` first on ``sys.path``: ``from gpt import GPT``). Each
# root is its own copy of the classes, so a sibling must be imported under the root its importer used
# (``__package__`` is "examples" under the first, "" under the second). gpt_module.py and gpt_pipeline.py
# import this file that way; this file hands out their names lazily (PEP 562), so that importing either
# of them first never meets a half-initialised module.
_ELSEWHERE = {
    "gpt_pipeline": ("Embeddings", "LMHead", "TIED_KEY", "tied_lm_head", "gpt_layer_specs", "gpt_pipeline",
                     "convert_gpt_state_dict"),
    "gpt_module": ("GPTModule", "OptimConfig", "OPTIMIZERS", "lr_lambda"),
}


def __getattr__(name: str) -> Any:
    """The names of gpt_pipeline.py and gpt_module.py, from their module under this file's import root."""
    for module, names in _ELSEWHERE.items():
        if name in names:
            return getattr(importlib.import_module(f"{__package__}.{module}" if __package__ else module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # what __getattr__ hands out, for type checkers and editors
    from .gpt_module import OPTIMIZERS, GPTModule, OptimConfig, lr_lambda
    from .gpt_pipeline import (
        TIED_KEY, Embeddings, LMHead, convert_gpt_state_dict, gpt_layer_specs, gpt_pipeline, tied_lm_head,
    )


__all__ = [
    "GPTConfig", "GPT", "Block", "Embeddings", "LMHead", "GPTModule", "OptimConfig", "OPTIMIZERS",
    "gpt_layer_specs", "gpt_pipeline", "convert_gpt_state_dict", "tied_lm_head", "TIED_KEY", "lm_loss",
    "flops_per_token", "matmul_params", "lr_lambda",
]
