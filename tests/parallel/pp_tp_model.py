"""A Llama-style model as a PipelineModule, tensor-parallelized per pipeline stage in configure_model.

Layers: a tied embedding, ``blocks`` decoder blocks (RMSNorm, grouped-query causal attention with
separate q/k/v/o projections, SwiGLU MLP with gate/up/down projections: the names of HF Llama's plan),
a final RMSNorm and the embedding reused as head. The same LightningModule trains on one process
(layers in sequence, no mesh: the oracle) and under ZeroStrategy(pipeline_stages=2, tensor_parallel=2),
where configure_model applies :data:`LAYER_PLAN` to the layers this stage holds
(lightning_zero/parallel/stage.py [Note: TP plans per pipeline stage]).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero.parallel import parallelize, stage_plan
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from tests.pipeline.pipe_model import RandomTokens

VOCAB, DIM, HEAD_DIM, KV_HEADS_RATIO, HIDDEN = 37, 32, 8, 2, 64
"""Tokens as tests/pipeline/pipe_model.py's RandomTokens (vocabulary 37, sequence 8); 4 query heads,
2 KV heads."""

LAYER_PLAN = {
    "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
    "attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}
"""Megatron's pairing inside one block (as lightning_zero.parallel.tp_plan_llama)."""

INTERLEAVED_PARTITION = (0, 1, 2, 3, 5)
"""Four parts of the 2-block model for 2 stages x 2 virtual stages: rank 0 holds the embedding (chunk 0)
and block 1 (chunk 1), rank 1 block 0 (chunk 0) and the norm and tied head (chunk 1), so each rank has
a TP block and the tied embedding lives in a different chunk on each."""


class Attention(nn.Module):
    """Causal grouped-query attention; head counts come from the projections' (local) widths, so a
    column split over tp leaves each rank its heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM // KV_HEADS_RATIO, bias=False)
        self.v_proj = nn.Linear(DIM, DIM // KV_HEADS_RATIO, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = (z.repeat_interleave(q.shape[1] // z.shape[1], dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def head(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, embedding.weight)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


class PPTPNet(LightningModule):
    """The PipelineModule is built in ``__init__`` (the strategy keeps this stage's layers before
    ``configure_model``), parallelized in ``configure_model`` when the mesh has a tp dim > 1."""

    def __init__(self, blocks: int = 2, global_batch: int = 8, n_train: int = 48, lr: float = 1e-2,
                 partition: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        specs = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), *[LayerSpec(Block) for _ in range(blocks)],
                 LayerSpec(nn.RMSNorm, DIM), TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head)]
        if partition is None:  # a block per stage; the one-process oracle ignores it (layers seeded by index)
            partition = [0, 1 + blocks // 2, len(specs)]
        self.pipe = PipelineModule(specs, token_loss, partition=partition)
        self.global_batch, self.n_train, self.lr = global_batch, n_train, lr
        self.losses: list[float] = []
        self.tp_params = 0

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or mesh["tp"].size() == 1 or self.tp_params:
            return
        parallelize(self.pipe, mesh["tp"], stage_plan(self.pipe, LAYER_PLAN))
        self.tp_params = sum(1 for n, p in self.pipe.named_parameters() if type(p).__name__ == "DTensor")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipe(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        data = RandomTokens(self.n_train)
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=self.global_batch // kwargs["num_replicas"], sampler=sampler)
