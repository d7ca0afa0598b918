"""Scenario ``parallel.tp`` (tests/helpers/harness.py): tensor parallel x ZeRO against a plain single-process torch loop.

Runs ``{NAME: SPEC}`` (``run_worker``), SPEC
``zeroK:tp=T,model=llama|gpt[,build=configure|init|load,offload_optimizer=cpu|nvme,offload_params=cpu|nvme,
offload_ratio=R,precision=P]`` (a Trainer fit under ZeroStrategy(stage=K, tensor_parallel=T, offload options), the
LightningModule applying the model's ready plan to ``self.device_mesh["tp"]`` in configure_model; ``build``: where
the model's weights come from, see :func:`make_module`) or
``ref:model=llama|gpt`` (rank 0 only: the same model, data, AdamW and clipping in a plain torch loop on
one process, the oracle). Rank 0 writes ``OUT/NAME.pt``: per-step global losses, final full weights,
and per-rank optimizer-state bytes with the numbers they are checked against.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.parallel import tp_plan_gpt, tp_plan_llama  # noqa: E402
from lightning_zero.parallel.dtensor import local_block, local_tensor  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.helpers.worker_io import run_against_oracle  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.helpers.launch import worker_accelerator  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR, CLIP = 6, 8, 16, 48, 1e-2, 0.05


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """The model with the oracle's initial weights wherever it is built: on the meta device (stage 3's
    configure_model) as it is, on a GPU (Lightning's configure_model runs under the root device) on the CPU
    from the CPU generator's values, as the CPU oracle draws them (CUDA's generator gives other values); the
    strategy moves it to the GPU as it moves any model built on the CPU."""
    if torch.empty(()).device.type == "cuda":
        with torch.device("cpu"):
            return build(kind, seed)
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        return LlamaForCausalLM(cfg)
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, seq_len=SEQ, tie_weights=False))


def loss_of(kind: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind == "llama":
        return model(input_ids=x, labels=x).loss
    from examples.gpt import lm_loss

    return lm_loss(model(x[:, :-1]), x[:, 1:])


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=g)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (DTensors gathered over tp: collective)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone().cpu()
    return out


class TPModule(pl.LightningModule):
    """The model built in ``__init__`` (``model`` given) or in configure_model, and parallelized there,
    as under ModelParallelStrategy. Weights built or loaded in ``__init__`` are the user's: no hook
    re-creates them, so they train from exactly the oracle's values only if every stage keeps them."""

    def __init__(self, kind: str, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.model = model
        self.losses: list[float] = []
        self.mesh_seen: tuple | None = None
        self.parallelized = False

    def configure_model(self) -> None:
        if self.parallelized:  # configure_model runs again for validate/test/predict
            return
        model = self.model if self.model is not None else build(self.kind)
        mesh = self.device_mesh
        self.mesh_seen = (tuple(mesh.mesh_dim_names), tuple(mesh.shape))
        tp = mesh["tp"]
        if tp.size() > 1:
            plan = tp_plan_llama(model, tp) if self.kind == "llama" else tp_plan_gpt(model, tp)
            parallelize_module(model, tp, plan)
        self.model = model
        self.parallelized = True

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.kind, self.model, batch[0])
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    def train_dataloader(self):
        dims = self.trainer.strategy.dims  # data sharded by dp rank only: the tp ranks of a replica share it
        return DataLoader(TensorDataset(tokens()[dims.dp_rank :: dims.dp]), batch_size=BATCH // dims.dp, shuffle=False)


class MetaBuiltTPModule(TPModule):
    """The model built in configure_model: ZeRO-3 builds it on the meta device and materialises it unit
    by unit, where ``zero_init_module`` copies the oracle's initial weights in (slicing TP shards)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.init_values = {n: p.detach().clone() for n, p in build(kind).named_parameters()}

    def zero_init_module(self, module: torch.nn.Module) -> None:
        prefix = {id(m): n for n, m in self.model.named_modules()}[id(module)]
        for name, p in module.named_parameters(recurse=False):
            full = self.init_values[f"{prefix}.{name}" if prefix else name]
            shape, offset = local_block(p)  # a DTensor's TP shard: its block of the full tensor
            local_tensor(p).copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))])


def make_module(kind: str, how: str, out: str) -> TPModule:
    """``configure``: built in configure_model (meta under stage 3, initialised through the hook);
    ``init``: built in ``__init__`` with the oracle's seed; ``load``: built in ``__init__`` from another
    seed, then loaded from a saved ``state_dict`` of the oracle's model (a pretrained checkpoint)."""
    if how == "configure":
        return MetaBuiltTPModule(kind)
    if how == "init":
        return TPModule(kind, build(kind))
    assert how == "load", how
    path = os.path.join(out, f"_pretrained_{kind}_rank{os.environ.get('RANK', '0')}.pt")
    torch.save(build(kind).state_dict(), path)
    model = build(kind, seed=123)
    model.load_state_dict(torch.load(path, weights_only=True))
    os.remove(path)
    return TPModule(kind, model)


def run_zero(stage: int, opts: dict[str, str], out: str) -> dict:
    kind = opts.get("model", "llama")
    tp = int(opts.get("tp", "2"))
    module = make_module(kind, opts.get("build", "configure"), out)
    extra: dict = {"param_persistence_threshold": 0} if stage == 3 else {}  # a tiny model: gather/release every unit
    for key in ("offload_optimizer", "offload_params"):  # ZeRO-Offload / ZeRO-Infinity on the local TP shards
        if key in opts:
            extra[key] = opts[key]
    if "nvme" in (opts.get("offload_optimizer"), opts.get("offload_params")):  # removed after the run
        extra["nvme_path"] = tempfile.mkdtemp(prefix="tp_nvme_")
    if "offload_ratio" in opts:
        extra["offload_ratio"] = float(opts["offload_ratio"])
    strategy = lightning_zero.ZeroStrategy(stage=stage, tensor_parallel=tp, bucket_size_mb=0.002, **extra)
    trainer = pl.Trainer(
        accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=STEPS,
        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, precision=opts.get("precision", "32-true"), use_distributed_sampler=False,
    )
    try:
        trainer.fit(module)
    finally:
        if "nvme_path" in extra:
            atexit.register(shutil.rmtree, extra["nvme_path"], True)  # after the engines close their swap files
    engine = strategy.engines[0]
    opt = trainer.optimizers[0]
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    local_numel = sum(p._local_tensor.numel() if isinstance(p, DTensor) else p.numel() for p in module.model.parameters())
    mine = {
        "state_bytes": storage_bytes(state),
        "shard_numel": sum(fg.layout.shard_numel for fg in engine.groups),
        "buckets": sum(len(fg.layout.buckets) for fg in engine.groups),
        "local_numel": local_numel,
        "full_numel": sum(p.numel() for p in module.model.parameters()),
        "dtensor_params": sum(isinstance(p, DTensor) for p in module.model.parameters()),
        "dtensor_dtypes": sorted({str(p.dtype) for p in module.model.parameters() if isinstance(p, DTensor)}),
        "local_dtypes": sorted({str(local_tensor(p).dtype) for p in module.model.parameters() if isinstance(p, DTensor)}),
        "dp": strategy.dims.dp, "tp": strategy.dims.tp, "tp_rank": strategy.dims.tp_rank, "dp_rank": strategy.dims.dp_rank,
        "losses": list(module.losses),
        "mesh_seen": module.mesh_seen,
        "strategy_mesh": tuple(strategy.device_mesh.shape),
        "grad_norm": strategy.grad_norm,
        # stage 3: what the parameters hold between steps (released: nothing) and the partition gathered from
        "held_param_bytes": storage_bytes(local_tensor(p) for p in module.model.parameters()),
        "param_shard_bytes": storage_bytes(engine.param_shards()) if stage == 3 and "offload_params" not in opts else None,
    }
    per_rank = C.all_gather_object(mine, None)
    with strategy.gathered_params() if stage == 3 else contextlib.nullcontext():  # stage 3 released them
        weights = full_weights(module.model)
    return {"losses": list(module.losses), "weights": weights, "per_rank": per_rank}


def run_ref(opts: dict[str, str]) -> dict:
    kind = opts.get("model", "llama")
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = tokens()
    losses = []
    for k in range(STEPS):
        loss = loss_of(kind, model, data[k * BATCH:(k + 1) * BATCH])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@scenario("parallel.tp")
def runs(ctx: ScenarioContext) -> None:
    # the oracle: one process, no strategy
    run_against_oracle(lambda stage, opts: run_zero(stage, opts, str(ctx.out)), run_ref, ctx)
