"""Scenario ``moe.zero_ep`` (tests/helpers/harness.py): the MoE GPT under ZeroStrategy(expert_parallel=EP) against one process.

Runs ``{NAME: SPEC}`` (``run_worker``), SPEC
``zeroK:ep=E,top_k=T`` (a Trainer fit under ZeroStrategy(stage=K, expert_parallel=E) on the N ranks) or
``ref:top_k=T`` (rank 0 only: the oracle, a plain torch loop in one process). Rank 0 writes
``OUT/NAME.pt``: per-step global losses and gradient norms, the final weights in the global naming
(moe/parallel.py [Note: expert state by global index]) and per-rank facts.

The oracle: the same GPT holding all experts, same initial weights, AdamW, clipping by the global norm
at a value that binds. The auxiliary loss is a per-micro-batch quantity (its router statistics are
those of the tokens of one forward, as in DeepSpeed), so the oracle runs the global batch as the N
ranks' micro-batches one after another, each loss divided by N, gradients accumulated: the same
average of per-rank losses the data-parallel ranks optimise. Without token dropping everything else is
per token.
"""

from __future__ import annotations

import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from examples.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.moe import aux_loss  # noqa: E402
from lightning_zero.moe.parallel import globalize_expert_state, localize_expert_state, moe_layers  # noqa: E402
from tests.helpers.worker_io import run_against_oracle  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR, CLIP, E = 4, 8, 16, 48, 1e-2, 0.5, 4


def config(top_k: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, seq_len=SEQ, tie_weights=False, bias=False,
                     moe_experts=E, moe_every=2, moe_top_k=top_k, moe_drop_tokens=False, moe_aux_loss_coef=0.1)


def initial_state(top_k: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(config(top_k)).state_dict()


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=g)


def shard(data: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of step ``step`` (rows ``rank::world`` of the data, BATCH / world per step)."""
    mine = data[rank::world]
    n = BATCH // world
    return mine[step * n:(step + 1) * n]


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(x[:, :-1]), x[:, 1:]) + aux_loss(model)


class MoEModule(pl.LightningModule):
    """The MoE GPT given the strategy's expert-parallel group in configure_model, starting from the
    single-process model's weights (this rank's experts of them)."""

    def __init__(self, top_k: int, ep: int) -> None:
        super().__init__()
        self.top_k, self.ep = top_k, ep
        torch.manual_seed(100 + C.rank())  # whatever the layers make is overwritten in configure_model
        self.model = GPT(config(top_k), ep_size=ep)  # real weights (ZeRO-3 builds configure_model's on meta)
        self.init_state = initial_state(top_k)
        self.loaded = False
        self.losses: list[float] = []
        self.norms: list[float] = []

    def configure_model(self) -> None:
        if self.loaded:
            return
        group = self.trainer.strategy.expert_parallel_group
        for _, layer in moe_layers(self.model):  # the group known in configure_model: as MoE(..., ep_group=group)
            layer.set_ep_group(group)
        self.model.load_state_dict(localize_expert_state(self.init_state, self.model))
        self.loaded = True

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.model, batch[0])
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.norms.append(float(self.trainer.strategy.grad_norm))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    def train_dataloader(self):
        world = int(os.environ["WORLD_SIZE"])
        rank = self.trainer.strategy.global_rank
        rows = torch.cat([shard(tokens(), k, rank, world) for k in range(STEPS)])
        return DataLoader(TensorDataset(rows), batch_size=BATCH // world, shuffle=False)


def run_zero(stage: int, opts: dict[str, str]) -> dict:
    top_k, ep = int(opts.get("top_k", "1")), int(opts.get("ep", "2"))
    module = MoEModule(top_k, ep)
    strategy = lightning_zero.ZeroStrategy(stage=stage, expert_parallel=ep, bucket_size_mb=0.002,
                                           param_persistence_threshold=0)  # stage 3: gathered unit by unit
    trainer = pl.Trainer(
        accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=STEPS,
        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, precision="32-true", use_distributed_sampler=False,
    )
    trainer.fit(module)
    with strategy.gathered_params():
        weights = globalize_expert_state({k: v.detach().clone() for k, v in module.model.state_dict().items()},
                                         module.model)
    engine = strategy.engines[0]
    dims = strategy.dims
    mine = {
        "weights": weights, "losses": module.losses, "norms": module.norms,
        "ep_rank": dims.ep_rank, "edp_rank": dims.edp_rank,
        "expert_shards": [fg.layout.num_shards for fg, c in zip(engine.groups, engine.comms) if c is engine.expert_comm],
        "dense_shards": [fg.layout.num_shards for fg, c in zip(engine.groups, engine.comms) if c is engine.dp_comm],
    }
    per_rank = C.all_gather_object(mine, None)
    merged: dict[str, torch.Tensor] = {}
    for r in per_rank:
        merged.update(r["weights"])
    return {"losses": module.losses, "norms": module.norms, "weights": merged,
            "per_rank": [{k: v for k, v in r.items() if k != "weights"} for r in per_rank]}


def run_ref(opts: dict[str, str], world: int) -> dict:
    top_k = int(opts.get("top_k", "1"))
    model = GPT(config(top_k))
    model.load_state_dict(initial_state(top_k))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = tokens()
    losses, norms = [], []
    for k in range(STEPS):
        total = 0.0
        for r in range(world):  # the ranks' micro-batches, one after another
            loss = loss_of(model, shard(data, k, r, world)) / world
            loss.backward()
            total += float(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@scenario("moe.zero_ep")
def runs(ctx: ScenarioContext) -> None:
    run_against_oracle(run_zero, lambda opts: run_ref(opts, int(os.environ["WORLD_SIZE"])), ctx)
