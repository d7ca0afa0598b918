"""A GPT-style causal language model and its LightningModule: the example workload.

Small enough to train on two CPU cores (``conf/model/gpt_small.yaml``) and, unchanged, the 1.3B-parameter
benchmark model (``conf/model/gpt_1b.yaml``). It deliberately contains what stresses a ZeRO engine:
a weight shared by two uses (the tied embedding / output head), parameter groups with different weight
decay, an LR scheduler stepped every step, and optional activation checkpointing.

The model is built in :meth:`GPTModule._build_model` only, so that a later ZeRO-3 issue can move the call
into ``configure_model`` (sharded construction) without touching anything else.
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
from torch.utils.checkpoint import checkpoint
from typing_extensions import override


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

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model}).")
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}.")


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
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
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
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token + position embedding, pre-LN blocks, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        # Tied: the head *is* wte.weight (F.linear in forward), so the parameter exists exactly once and
        # ZeRO sees one parameter receiving gradient from two places. Untied: a separate Linear.
        self.lm_head: Optional[nn.Linear] = (
            None if cfg.tie_weights else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (batch, time) -> next-token logits (batch, time, vocab)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"Sequence of length {t} exceeds the model's seq_len {self.cfg.seq_len}.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        h = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(h, self.wte.weight)
        return self.lm_head(h)


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
    return cfg.n_layer * per_block + (d + d * bias) + cfg.vocab_size * d


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
    """One of 'adamw', 'adam', 'sgd'."""
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


OPTIMIZERS = ("adamw", "adam", "sgd")


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR: linear warm-up, then cosine decay to min_lr_ratio, flat afterwards."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """Next-token cross-entropy training of :class:`GPT`, with AdamW/Adam/SGD and warm-up + cosine LR.

    ``max_steps`` is the horizon of the cosine schedule; None takes the trainer's estimate at
    ``configure_optimizers`` time. The module exposes ``flops_per_token`` for
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
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"Unknown optimizer {optimizer!r}; valid choices are {list(OPTIMIZERS)}.")
        self.config = model if isinstance(model, GPTConfig) else GPTConfig(**dict(model))
        self.optim = OptimConfig(
            name=optimizer, lr=lr, weight_decay=weight_decay, betas=(float(betas[0]), float(betas[1])), eps=eps,
            momentum=momentum, fused=fused, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
        )
        self.max_steps = max_steps
        # Plain containers only (exactly this constructor's arguments), so load_from_checkpoint can rebuild
        # the module and TensorBoard can show them.
        optim = asdict(self.optim)
        self.save_hyperparameters(
            {"model": asdict(self.config), "max_steps": max_steps, "optimizer": optim.pop("name"), **optim}
        )
        self.flops_per_token = flops_per_token(self.config)
        self.model = self._build_model()

    def zero_init_module(self, module: nn.Module) -> None:
        """GPT-2 initialisation of one module, for ZeRO-3's sharded construction.

        ZeRO-3 materialises a ``configure_model``-built network one unit at a time and calls this hook
        for each module it materialises (after the module's own ``reset_parameters``), so the result
        matches :meth:`GPT.reset_parameters` without the whole model ever existing on one rank.
        """
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return
        std = 0.02
        blocks = getattr(self.model, "blocks", None) or []
        if any(module is b.attn.proj or module is b.mlp.proj for b in blocks):
            std /= math.sqrt(2 * self.config.n_layer)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _build_model(self) -> GPT:
        """The one place the network is constructed (a ZeRO-3 issue will call it from configure_model)."""
        return GPT(self.config)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

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
        if o.name == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)
        elif o.name == "adam":
            optimizer = torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)
        else:
            optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
        max_steps = self.max_steps if self.max_steps is not None and self.max_steps > 0 else None
        if max_steps is None:
            max_steps = int(self.trainer.estimated_stepping_batches)
        horizon, warmup, floor = max_steps, o.warmup_steps, o.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, warmup, horizon, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


__all__ = [
    "GPTConfig", "GPT", "Block", "GPTModule", "OptimConfig", "OPTIMIZERS",
    "flops_per_token", "matmul_params", "lr_lambda",
]
