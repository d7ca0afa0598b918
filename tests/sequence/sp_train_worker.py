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
import lightning_zero.sequence  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.worker_io import run_against_oracle  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR, CLIP, SAMPLES = 4, 2, 32, 64, 1e-2, 0.5, 16


HF_KINDS = ("llama", "qwen2", "mistral")
"""HF models built from configs (sp_model_worker.build): Llama; Qwen2, whose q/k/v projections carry biases;
Mistral, whose sliding window (``window``, default the sequence length) is refused when shorter than the
sequence and changes nothing when it covers it."""


def build(kind: str = "llama", window: int = SEQ) -> torch.nn.Module:
    from tests.sequence.sp_model_worker import build as build_hf

    model = build_hf(kind, window)
    if kind == "qwen2":  # the key bias's gradient comes out of nearly cancelling sums (softmax ignores a per-query
        # shift; only the rotary embedding leaves a little), so summation order alone moves it past 1e-4 in 4 Adam
        # steps: one process with eager attention in place of SDPA differs from SDPA by 1.3e-4 there. Frozen in
        # both runs; the query and value biases train.
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.requires_grad_(False)
    return model


class NanoAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention, with the one-line hook in place of F.scaled_dot_product_attention
    (``hook=False``: the plain call, which sequence parallelism must refuse)."""

    def __init__(self, d: int, heads: int, hook: bool) -> None:
        super().__init__()
        # bias=False (nanoGPT's option): the key bias's gradient is zero in exact arithmetic (softmax ignores a
        # per-row shift), so Adam turns its rounding noise into full-size steps that no two summation orders share
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d)
        self.n_head, self.hook = heads, hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.hook:
            y = lightning_zero.sequence.attention(self, q, k, v, is_causal=True)
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class NanoBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int, hook: bool) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = torch.nn.LayerNorm(d), NanoAttention(d, heads, hook), torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(torch.nn.Module):
    """nanoGPT's layout (ModuleDict, tied head); positions through the hook."""

    def __init__(self, hook: bool = True, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(VOCAB, d), wpe=torch.nn.Embedding(SEQ, d),
            h=torch.nn.ModuleList([NanoBlock(d, heads, hook) for _ in range(layers)]), ln_f=torch.nn.LayerNorm(d)))
        self.lm_head = torch.nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = lightning_zero.sequence.positions(self, idx.shape[1], idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def example_gpt() -> torch.nn.Module:
    """The example's GPT (examples/gpt.py), which calls the hook; bias=False for the reason NanoAttention gives."""
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, seq_len=SEQ, bias=False))


def make_model(kind: str, window: int = SEQ) -> torch.nn.Module:
    """The model a run trains: an HF model (HF_KINDS), the example GPT (``gpt``), or the nanoGPT layout with the
    hook (``nano``) or calling SDPA itself (``nano_plain``)."""
    if kind in HF_KINDS:
        return build(kind, window)
    return example_gpt() if kind == "gpt" else NanoGPT(hook=kind == "nano")


def nano_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a nanoGPT user writes under the hook: the summed token loss over the batch's (split) targets,
    divided by the global count the strategy passes; the plain shift on one process."""
    labels = batch.get("shift_labels")
    if labels is None:
        labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1), value=-100)
        count = (labels != -100).sum()
    else:
        count = batch["num_items_in_batch"]
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum") / count


class Tokens(Dataset):
    """Random token rows; ``packed``: rows hold two documents (position ids restart), labels -100 on each
    document's first token, as DataCollatorWithFlattening writes them."""

    def __init__(self, packed: bool, samples: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)[:samples]
        self.packed = packed

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        if not self.packed:
            return {"input_ids": ids}
        cut = 5 + (3 * i) % 20
        pos = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])
        return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}


class LlamaModule(pl.LightningModule):
    """What a user writes: the HF model, ``self.model(**batch).loss``."""

    def __init__(self, packed: bool, kind: str = "llama", window: int = SEQ, samples: int = SAMPLES) -> None:
        super().__init__()
        self.model = make_model(kind, window)
        self.samples = samples
        self.packed, self.kind = packed, kind
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.kind not in HF_KINDS:
            loss = nano_loss(self.model, batch)
        else:
            if "labels" not in batch:
                batch = {**batch, "labels": batch["input_ids"]}
            loss = self.model(**batch).loss
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transferred = batch["input_ids"].shape[1]  # the strategy splits on the host: the slice moves
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(Tokens(self.packed, self.samples), batch_size=BATCH, shuffle=False)


def _strategy(stage: int, sp: int, opts: dict[str, str]) -> "lightning_zero.ZeroStrategy":
    extra: dict = {"param_persistence_threshold": 0} if stage == 3 else {}
    if opts.get("offload") == "1":
        extra.update(offload_optimizer="cpu", offload_params="cpu")
    if "act" in opts:  # activation offload, ``act`` the share of the checkpoints kept on the device
        extra.update(activation_offload=True, activation_offload_device_fraction=float(opts["act"]))
    return lightning_zero.ZeroStrategy(
        stage=stage, sequence_parallel=sp, sequence_attention=opts.get("attn", "auto"),
        sequence_layout=opts.get("layout", "zigzag"), tiled_mlp=int(opts.get("tiled", 1)), bucket_size_mb=0.002,
        **extra)


def _module(opts: dict[str, str]) -> LlamaModule:
    return LlamaModule(opts.get("packed") == "1", opts.get("model", "llama"), int(opts.get("window", SEQ)),
                       int(opts.get("samples", SAMPLES)))


def _trainer(strategy: "lightning_zero.ZeroStrategy", norms: list[float], callbacks: tuple = (),
             **limits) -> pl.Trainer:
    class Norms(pl.Callback):  # the global norm before clipping, read after each step
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            norms.append(float(strategy.grad_norm))

    return pl.Trainer(accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      gradient_clip_val=CLIP, logger=False, enable_checkpointing=bool(callbacks),
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Norms(), *callbacks], **limits)


def _result(strategy: "lightning_zero.ZeroStrategy", stage: int, module: LlamaModule, losses: list[float],
            norms: list[float]) -> dict:
    with strategy.gathered_params() if stage == 3 else contextlib.nullcontext():
        weights = {n: p.detach().clone().cpu() for n, p in module.model.named_parameters()}
    dims = strategy.dims
    attn = module.model.config._attn_implementation if hasattr(module.model, "config") else "hook"
    per_rank = C.all_gather_object({"sp_rank": dims.sp_rank, "data_rank": dims.data_rank, "attn": attn,
                                    "transferred": module.transferred}, None)
    return {"losses": losses, "grad_norms": norms, "weights": weights, "per_rank": per_rank}


def run_zero(stage: int, opts: dict[str, str], out: str) -> dict:
    if "resume_stage" in opts:
        return run_resumed(stage, opts, out)
    strategy = _strategy(stage, int(opts["sp"]), opts)
    module = _module(opts)
    norms: list[float] = []
    trainer = _trainer(strategy, norms, max_steps=STEPS)
    try:
        trainer.fit(module)
    except ValueError as err:
        if opts.get("expect") != "refused":
            raise
        return {"error": str(err), "steps": trainer.global_step}
    return _result(strategy, stage, module, module.losses, norms)


def run_resumed(stage: int, opts: dict[str, str], out: str) -> dict:
    """Epoch 0 at ``stage`` with ``sp``, a Lightning checkpoint at its end, then a new Trainer at ``resume_stage``
    with ``resume_sp`` resumed from it (``trainer.fit(ckpt_path=...)``) for epoch 1: both epochs' losses and
    gradient norms and the final weights (against the one-process run of the same batches, uninterrupted)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_dir = os.path.join(out, f"ckpt_zero{stage}_sp{opts['sp']}_to_zero{opts['resume_stage']}_sp{opts['resume_sp']}")
    first = _module(opts)
    norms: list[float] = []
    saver = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
    _trainer(_strategy(stage, int(opts["sp"]), opts), norms, (saver,), max_epochs=1).fit(first)
    resumed_stage = int(opts["resume_stage"])
    strategy = _strategy(resumed_stage, int(opts["resume_sp"]), opts)
    second = _module(opts)
    _trainer(strategy, norms, max_epochs=2).fit(second, ckpt_path=saver.last_model_path or saver.best_model_path)
    return _result(strategy, resumed_stage, second, first.losses + second.losses, norms)


def schedule(opts: dict[str, str]) -> list[tuple[int, int, int]]:
    """The steps of a reference run as ``(replicas, epoch, step in epoch)``: ``STEPS`` steps of epoch 0 with
    ``dp`` replicas; with ``then_dp``, the whole of epoch 0 with ``dp`` and then the whole of epoch 1 with
    ``then_dp`` (what a run resumed at the epoch boundary under another data-parallel degree trains)."""
    dp = int(opts.get("dp", "1"))
    if "then_dp" not in opts:
        return [(dp, 0, k) for k in range(STEPS)]
    samples = int(opts.get("samples", SAMPLES))
    return [(d, epoch, k) for epoch, d in enumerate((dp, int(opts["then_dp"]))) for k in range(samples // (d * BATCH))]


def run_ref(opts: dict[str, str]) -> dict:
    packed = opts.get("packed") == "1"
    kind = opts.get("model", "llama")
    model = make_model(kind, int(opts.get("window", SEQ)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = Tokens(packed, int(opts.get("samples", SAMPLES)))
    losses, norms = [], []
    for replicas, epoch, k in schedule(opts):
        total = torch.zeros(())
        for r in range(replicas):  # Lightning's training sampler: DistributedSampler(shuffle=True, seed=0)
            sampler = DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            idx = list(sampler)[k * BATCH:(k + 1) * BATCH]
            rows = [data[i] for i in idx]
            batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
            if kind not in HF_KINDS:
                loss = nano_loss(model, batch)
            elif packed:
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
    run_against_oracle(lambda stage, opts: run_zero(stage, opts, str(ctx.out)), run_ref, ctx)
