"""A GPT-style causal language model and its LightningModule: the example workload.

Small enough to train on two CPU cores (``conf/model/gpt_small.yaml``) and, unchanged, the 1.3B-parameter
benchmark model (``conf/model/gpt_1b.yaml``). It deliberately contains what stresses a ZeRO engine:
a weight shared by two uses (the tied embedding / output head), parameter groups with different weight
decay, an LR scheduler stepped every step, and optional activation checkpointing.

Two forms of one network, with the same layers and the same GPT-2 initialisation:

* :class:`GPT`, a plain ``nn.Module`` (``blocks`` in an ``nn.ModuleList``), what :class:`GPTModule`
  trains by default: under ``ddp``/``zero0-3``, the benchmarks and Lightning's peers (FSDP, DeepSpeed);
* :func:`gpt_pipeline`, the same layers as a :class:`lightning_zero.pipeline.PipelineModule`
  (:func:`gpt_layer_specs`: tied embedding, blocks, final LayerNorm, the embedding again as the head),
  what ``GPTModule(pipeline=True)`` trains: pipeline stages under ``strategy=pipeline``
  (``examples/train.py`` picks the form from the strategy). A PipelineModule also runs its layers in
  sequence under the other strategies, but there it would only hide the model from Lightning's
  summary (a ``PipelineModule`` of 0 FLOPs), so it is not the default.

:class:`GPTModule` trains whichever of the two its :meth:`GPTModule._build_model` (or a subclass's
``configure_model``) puts in ``self.model``; its checkpoints load into either form
(:func:`convert_gpt_state_dict`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_zero import ZeroStrategy, sequence
from lightning_zero.callbacks import LayerDropPlan, ProgressiveLayerDrop
from lightning_zero.logging import MoEMetrics
from lightning_zero.moe import MoE, aux_loss
from lightning_zero.parallel import parallelize, tp_plan_gpt
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

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


@dataclass
class OptimConfig:
    """Optimizer and LR schedule of :class:`GPTModule`; ``conf/optimizer/*.yaml`` are presets of it."""

    name: str = "adamw"
    """One of 'adamw', 'adam', 'sgd', 'onebit_adam', 'onebit_lamb' (the 1-bit ones need strategy=zero0)."""
    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""
    weight_decay: float = 0.1
    """Applied to Linear weights only; biases, LayerNorm weights and embeddings get none."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    fused: Optional[bool] = None
    """Ask torch for its fused Adam/AdamW kernel; None keeps torch's default."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at max_steps."""
    freeze_fraction: float = 0.15
    """1-bit optimizers: the exact warm-up (variance still adapting) lasts this fraction of max_steps."""


OPTIMIZERS = ("adamw", "adam", "sgd", "onebit_adam", "onebit_lamb")


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR: linear warm-up, then cosine decay to min_lr_ratio, flat afterwards."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """Next-token cross-entropy training of the GPT, with AdamW/Adam/SGD and warm-up + cosine LR.

    ``self.model`` is the plain :class:`GPT` (default), or with ``pipeline=True`` :func:`gpt_pipeline`
    (a PipelineModule, needed by pipeline stages). The steps work with either, whichever
    ``_build_model`` (or a subclass's ``configure_model``) put there. The plain form has an
    ``example_input_array`` (one sequence of token ids), so Lightning's model summary measures its
    FLOPs and shapes. ``max_steps`` is the horizon of the cosine schedule; None takes the
    trainer's estimate at ``configure_optimizers`` time. The module exposes ``flops_per_token`` for
    :class:`lightning_zero.logging.ZeroMetrics`.
    """

    def __init__(
        self,
        model: Union[GPTConfig, Mapping[str, Any]],
        lr: float = OptimConfig.lr,
        weight_decay: float = OptimConfig.weight_decay,
        betas: tuple[float, float] = OptimConfig.betas,
        warmup_steps: int = OptimConfig.warmup_steps,
        max_steps: Optional[int] = None,
        optimizer: str = OptimConfig.name,
        eps: float = OptimConfig.eps,
        momentum: float = OptimConfig.momentum,
        fused: Optional[bool] = OptimConfig.fused,
        min_lr_ratio: float = OptimConfig.min_lr_ratio,
        pipeline: bool = False,
        freeze_fraction: float = OptimConfig.freeze_fraction,
        expert_parallel: int = 1,
        deferred: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"Unknown optimizer {optimizer!r}; valid choices are {list(OPTIMIZERS)}.")
        self.config = model if isinstance(model, GPTConfig) else GPTConfig(**dict(model))
        self.optim = OptimConfig(
            name=optimizer, lr=lr, weight_decay=weight_decay, betas=(float(betas[0]), float(betas[1])), eps=eps,
            momentum=momentum, fused=fused, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
            freeze_fraction=freeze_fraction,
        )
        self.max_steps = max_steps
        self.use_pipeline = bool(pipeline)
        self.expert_parallel = int(expert_parallel)
        """The MoE layers' ep_size: the strategy's ``expert_parallel`` (examples/train.py passes it)."""
        # Plain containers only (exactly this constructor's arguments), so load_from_checkpoint can rebuild
        # the module and TensorBoard can show them.
        optim = asdict(self.optim)
        self.save_hyperparameters(
            {"model": asdict(self.config), "max_steps": max_steps, "optimizer": optim.pop("name"), **optim,
             "pipeline": self.use_pipeline, "expert_parallel": self.expert_parallel}
        )
        self.flops_per_token = flops_per_token(self.config)
        if self.config.pld and self.use_pipeline:
            raise ValueError("model.pld needs the plain GPT (its block loop drops layers); pipeline stages run a fixed layer list.")
        if self.config.moe_experts and self.use_pipeline:
            raise ValueError("model.moe_experts with pipeline stages is not built yet.")
        self.deferred = bool(deferred) and not self.use_pipeline
        """Build the plain GPT in ``configure_model`` (examples/train.py): inside the strategy's context, so
        ZeRO-3 creates it on the meta device and materialises only this rank's partition, and ddp/zero0-2
        build it on the device directly. Not a hyper-parameter: ``load_from_checkpoint`` builds eagerly.
        The pipeline form is always built here (its layers are created lazily, per stage, anyway)."""
        self.model = None if self.deferred else self._build_model()
        if self.config.compile and self.model is not None:
            self.compile_network()

    def compile_network(self) -> None:
        """``model.compile=true``: torch.compile every transformer :class:`Block` on its own (``.compile()``,
        parameter names unchanged), PyTorch's "regional compilation": the 24 blocks of GPT-1.3B share one
        graph, compiled in a fraction of the whole network's time, and the same code runs compiled under
        every strategy (ddp, FSDP's per-block units, ZeRO-3's units with their gathers outside the
        compiled regions, pipeline stages). The embeddings, final norm and head stay eager. The pipeline
        form's layers exist once the strategy placed them: it is compiled at fit start. Idempotent."""
        if self.model is None:
            return
        options = {"mode": self.config.compile_mode} if self.config.compile_mode else {}
        for module in self.model.modules():
            if isinstance(module, Block) and module._compiled_call_impl is None:
                module.compile(**options)

    @override
    def on_fit_start(self) -> None:
        if self.config.compile:
            self.compile_network()  # the pipeline form's layers are built by now

    @override
    def configure_callbacks(self) -> list[L.Callback]:
        """``model.moe_experts > 0``: MoEMetrics (aux loss, tokens per expert, dropped fraction to the loggers);
        ``model.pld=true``: Progressive Layer Dropping on the configured schedule."""
        callbacks: list[L.Callback] = [MoEMetrics()] if self.config.moe_experts else []
        if self.config.pld:
            callbacks.append(ProgressiveLayerDrop(theta=self.config.pld_theta, gamma=self.config.pld_gamma))
        return callbacks

    @property  # type: ignore[override]
    def example_input_array(self) -> Optional[Tensor]:
        """What Lightning's model summary runs through ``forward`` on every rank before training, to
        measure FLOPs and shapes: one sequence of token ids for the plain :class:`GPT` (so the summary
        does not report 0 FLOPs). None, and the FLOPs column stays unmeasured (Lightning prints 0),
        where a model call outside the step methods cannot run: the pipeline form (its forward is the
        schedule between stages) and ZeRO-3's partitioned parameters (gathered only inside steps;
        gathering the whole model here could exceed a rank's memory). A value set explicitly wins."""
        if self._example_input_array is not None:
            return self._example_input_array
        if not isinstance(getattr(self, "model", None), GPT) or self._params_partitioned():
            return None
        return torch.zeros((1, self.config.seq_len), dtype=torch.long)

    @example_input_array.setter
    def example_input_array(self, example: Optional[Tensor]) -> None:
        self._example_input_array = example

    def _params_partitioned(self) -> bool:
        """Whether the trainer's strategy releases parameters between steps (ZeRO stage 3)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return isinstance(strategy, ZeroStrategy) and strategy.config.stage == 3

    def zero_init_module(self, module: nn.Module) -> None:
        """GPT-2 initialisation of one module, for ZeRO-3's sharded construction.

        ZeRO-3 materialises a ``configure_model``-built network one unit at a time and calls this hook
        for each module it materialises (after the module's own ``reset_parameters``), so the result
        matches :meth:`GPT.reset_parameters` (or, in a PipelineModule, the layers' own initialisation:
        every :class:`Block`'s residual projections scaled) without the whole model ever existing on
        one rank.
        """
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return
        std = INIT_STD
        if id(module) in self._residual_projections():
            std /= math.sqrt(2 * self.config.n_layer)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _residual_projections(self) -> set[int]:
        """ids of every block's residual projections, in whichever form ``self.model`` has."""
        model = getattr(self, "model", None)
        if model is None:
            return set()
        return {id(p) for m in model.modules() if isinstance(m, Block) for p in m.residual_projections()}

    @override
    def configure_model(self) -> None:
        """``strategy.tensor_parallel > 1``: each block's MLP split over ``self.device_mesh["tp"]`` with
        the ready plan (:func:`lightning_zero.parallel.tp_plan_gpt`), as under Lightning's
        ModelParallelStrategy; ZeRO then partitions each rank's TP shard over the data-parallel ranks.
        The pipeline form holds only this stage's layers by now; its blocks get the same split over the tp
        ranks of the stage (lightning_zero/parallel/stage.py). With ``deferred=True`` the network itself is
        built here first. Idempotent (Lightning calls it again for validate/test)."""
        if self.model is None:
            self.model = self._build_model()
            if self.config.compile:
                self.compile_network()
        mesh = self.device_mesh
        if mesh is None or "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
            return
        if not any(isinstance(p, DTensor) for p in self.model.parameters()):
            parallelize(self.model, mesh["tp"], tp_plan_gpt(self.model, mesh["tp"]))

    def _build_model(self) -> Union[PipelineModule, GPT]:
        """The one place the network is constructed.

        Subclasses may return None here and build it in ``configure_model`` instead (ZeRO-3's sharded
        initialisation, see ``benchmarks/peers_worker.py``). A PipelineModule builds its layers lazily,
        on first use: built in ``configure_model``, call its ``materialize()`` there, so that the layers
        are created inside the strategy's sharded context.
        """
        return gpt_pipeline(self.config) if self.use_pipeline else GPT(self.config, ep_size=self.expert_parallel)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Token ids -> logits (under pipeline stages: computed by the last stage, returned on every rank)."""
        if isinstance(self.model, PipelineModule):
            return self.model.predict(idx)
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        if isinstance(self.model, PipelineModule):
            # Under pipeline stages this runs the whole schedule (backward included when training) and
            # returns the mean loss over micro-batches on every rank.
            return self.model((x, y))
        loss = lm_loss(self(x), y)
        if self.config.moe_experts and self.training:  # the load-balancing loss of this forward's MoE layers
            loss = loss + aux_loss(self.model)
        return loss

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checkpoints of either form load into either (keys renamed by :func:`convert_gpt_state_dict`).
        A sharded checkpoint's ``state_dict`` is an empty marker (the strategy reads the pieces by
        name): left alone, so resuming it needs the form it was saved in; ``load_from_checkpoint``
        consolidates it first and converts as usual."""
        state = checkpoint.get("state_dict")
        model = getattr(self, "model", None)
        if isinstance(state, Mapping) and len(state) and model is not None:
            to_pipeline = isinstance(model, PipelineModule)
            checkpoint["state_dict"] = convert_gpt_state_dict(state, self.config, to_pipeline=to_pipeline)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        # Rank-local loss: sync_dist here would add a collective to every step.
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def param_groups(self) -> list[dict[str, Any]]:
        """Two groups: decay for Linear weights; none for biases, LayerNorm weights and embeddings."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        seen: set[int] = set()
        for module in self.model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(param)
        return [
            {"params": decay, "weight_decay": self.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @override
    def configure_optimizers(self) -> Any:
        o = self.optim
        groups = self.param_groups()
        optimizer: torch.optim.Optimizer
        max_steps = self.max_steps if self.max_steps is not None and self.max_steps > 0 else None
        if max_steps is None:
            max_steps = int(self.trainer.estimated_stepping_batches)
        if o.name in ("onebit_adam", "onebit_lamb"):
            from lightning_zero.optim import OneBitAdam, OneBitLamb

            freeze = max(1, int(o.freeze_fraction * max_steps))
            cls = OneBitAdam if o.name == "onebit_adam" else OneBitLamb
            optimizer = cls(groups, lr=o.lr, freeze_step=freeze, betas=o.betas, eps=o.eps)
        elif o.name == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)
        elif o.name == "adam":
            optimizer = torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)
        else:
            optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
        horizon, warmup, floor = max_steps, o.warmup_steps, o.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, warmup, horizon, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


__all__ = [
    "GPTConfig", "GPT", "Block", "Embeddings", "LMHead", "GPTModule", "OptimConfig", "OPTIMIZERS",
    "gpt_layer_specs", "gpt_pipeline", "convert_gpt_state_dict", "lm_loss",
    "flops_per_token", "matmul_params", "lr_lambda",
]
