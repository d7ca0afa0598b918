"""Scenario ``sequence.train`` (tests/helpers/harness.py): an HF Llama built from a config, trained under
``ZeroStrategy(sequence_parallel=N)`` by the Trainer, against the same training in one process on the whole
sequences (the oracle). Runs ``{NAME: "zeroS:sp=N,...", NAME: "ref:dp=D"}`` (``run_worker``). Options of a zero run: sp, attn (auto|ulysses|ring), layout, offload (1: stage 3 with CPU optimizer and
parameter offload), packed (1), tiled (MLP tiles). ``ref:dp=D``: one process, D data-parallel replicas'
batches per step (ddp's loss: the mean of the replicas' token means). Rank 0 writes ``OUT/NAME.pt``:
per-step losses (mean over ranks), gradient norms and the weights after the last step.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.worker_io import run_against_oracle  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR, CLIP, SAMPLES = 4, 2, 32, 64, 1e-2, 0.5, 16


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        attn_implementation="sdpa"))


class Tokens(Dataset):
    """Random token rows; ``packed``: rows hold two documents (position ids restart), labels -100 on each
    document's first token, as DataCollatorWithFlattening writes them."""

    def __init__(self, packed: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.packed = packed

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        if not self.packed:
            return {"input_ids": ids}
        cut = 5 + (3 * i) % 20
        pos = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])
        return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}


class LlamaModule(pl.LightningModule):
    """What a user writes: the HF model, ``self.model(**batch).loss``."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.model = build()
        self.packed = packed
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if "labels" not in batch:
            batch = {**batch, "labels": batch["input_ids"]}
        loss = self.model(**batch).loss
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(Tokens(self.packed), batch_size=BATCH, shuffle=False)


def run_zero(stage: int, opts: dict[str, str]) -> dict:
    extra: dict = {"param_persistence_threshold": 0} if stage == 3 else {}
    if opts.get("offload") == "1":
        extra.update(offload_optimizer="cpu", offload_params="cpu")
    strategy = lightning_zero.ZeroStrategy(
        stage=stage, sequence_parallel=int(opts["sp"]), sequence_attention=opts.get("attn", "auto"),
        sequence_layout=opts.get("layout", "zigzag"), tiled_mlp=int(opts.get("tiled", 1)), bucket_size_mb=0.002,
        **extra)
    module = LlamaModule(opts.get("packed") == "1")
    norms: list[float] = []

    class Norms(pl.Callback):  # the global norm before clipping, read after each step
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            norms.append(float(strategy.grad_norm))

    trainer = pl.Trainer(accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                         max_steps=STEPS, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Norms()])
    trainer.fit(module)
    with strategy.gathered_params() if stage == 3 else contextlib.nullcontext():
        weights = {n: p.detach().clone().cpu() for n, p in module.model.named_parameters()}
    dims = strategy.dims
    per_rank = C.all_gather_object({"sp_rank": dims.sp_rank, "data_rank": dims.data_rank,
                                    "attn": module.model.config._attn_implementation}, None)
    return {"losses": module.losses, "grad_norms": norms, "weights": weights, "per_rank": per_rank}


def run_ref(opts: dict[str, str]) -> dict:
    replicas = int(opts.get("dp", "1"))
    packed = opts.get("packed") == "1"
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = Tokens(packed)
    losses, norms = [], []
    for k in range(STEPS):
        total = torch.zeros(())
        for r in range(replicas):  # Lightning's training sampler: DistributedSampler(shuffle=True, seed=0)
            order = list(DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True, seed=0))
            idx = order[k * BATCH:(k + 1) * BATCH]
            rows = [data[i] for i in idx]
            batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
            if packed:
                loss = unpacked_loss(model, batch)
            else:
                loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            total = total + loss / replicas
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return {"losses": losses, "grad_norms": norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def unpacked_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token mean over every document run on its own (the unpacked run)."""
    total, count = torch.zeros(()), 0
    for ids, pos in zip(batch["input_ids"], batch["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
        for lo, hi in zip(starts[:-1], starts[1:]):
            logits = model(input_ids=ids[None, lo:hi]).logits[0]
            total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[lo + 1:hi], reduction="sum")
            count += hi - lo - 1
    return total / count



@scenario("sequence.train")
def runs(ctx: ScenarioContext) -> None:
    run_against_oracle(run_zero, run_ref, ctx)
