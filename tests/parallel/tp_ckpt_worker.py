"""Scenario ``parallel.tp_ckpt`` (tests/helpers/harness.py): sharded checkpoints of tensor-parallel x ZeRO runs, resumed on other layouts.

Runs ``{NAME: SPEC}`` (``run_worker``), SPEC

* ``save:stage=K,tp=T[,async=1]``: the Llama model of tp_worker.py under ZeroStrategy(stage=K, tensor_parallel=T),
  2 epochs of 3 fixed global batches (6 steps), ModelCheckpoint at each epoch's end into ``OUT/NAME``
  (``epoch=0-step=3.ckpt`` is the one resumed); records every step's global loss (the uninterrupted
  run) and the full weights at the end of epoch 0 (DTensors gathered over tp).
* ``resume:stage=K,tp=T,ckpt=REL[,fmt=full]``: the same run resumed from ``OUT/REL`` (a sharded
  directory of any layout, or a full file); at ``on_train_start`` it records the full weights as loaded
  and saves them again into ``OUT/NAME.ckpt`` (the state as loaded; ``fmt``: the strategy's
  checkpoint_format), then trains steps 3-5.
* ``fabric:stage=K,tp=T,ckpt=REL``: Fabric's door: load ``OUT/REL`` into a tensor-parallel module and
  its optimizer with ``fabric.load``, record the full weights, then ``fabric.save`` into ``OUT/NAME.ckpt``.
* ``mismatch:stage=K,tp=T,ckpt=REL``: resume ``OUT/REL`` into a model whose MLP is wider; each rank
  writes the error it got (rank 0 ``OUT/NAME.pt``, others ``OUT/NAME.rank<r>.pt``; run it last).

Weights are recorded full, by the LightningModule's state-dict names. Rank 0 writes
``OUT/NAME.pt`` (tests/helpers/worker_io.py), every rank's figures under ``per_rank``.
"""

from __future__ import annotations

import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.fit_epochs import fit_epochs  # noqa: E402
from lightning_zero.parallel import tp_plan_llama  # noqa: E402
from tests.helpers.worker_io import run_specs, save_atomic, save_result  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.parallel.tp_worker import BATCH, CLIP, LR, MetaBuiltTPModule, build, full_weights, loss_of, tokens  # noqa: E402

BATCHES_PER_EPOCH, EPOCHS = 3, 2


def _strategy(opts: dict[str, str], cls: type = lightning_zero.ZeroStrategy) -> object:
    stage = int(opts["stage"])
    extra: dict = {"param_persistence_threshold": 0} if stage == 3 else {}  # a tiny model: partition every unit
    if opts.get("fmt"):
        extra["checkpoint_format"] = opts["fmt"]
    if opts.get("async"):
        extra["checkpoint_async"] = True
    return cls(stage=stage, tensor_parallel=int(opts.get("tp", "1")), bucket_size_mb=0.002, timeout_s=120.0, **extra)


class CkptModule(MetaBuiltTPModule):
    """tp_worker's module over 3 fixed batches per epoch; records losses by global step and the full
    weights at given moments (collectives: every rank records)."""

    def __init__(self, resave: str = "", intermediate: int = 0) -> None:
        super().__init__("llama")
        self.resave = resave
        self.intermediate = intermediate
        self.step_losses: dict[int, float] = {}
        self.saved_weights: dict[str, torch.Tensor] = {}
        self.start: dict = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = build(self.kind)
        if self.intermediate:  # another model: the MLP's width differs
            from transformers import LlamaForCausalLM

            torch.manual_seed(0)
            model = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "intermediate_size": self.intermediate}))
        mesh = self.device_mesh  # None in one process without a process group
        if mesh is not None and mesh["tp"].size() > 1:
            parallelize_module(model, mesh["tp"], tp_plan_llama(model, mesh["tp"]))
        self.model = model

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.kind, self.model, batch[0])
        self.step_losses[self.global_step] = float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean"))
        return loss

    def train_dataloader(self):
        dims = self.trainer.strategy.dims
        data = tokens()[: BATCHES_PER_EPOCH * BATCH]
        return DataLoader(TensorDataset(data[dims.dp_rank :: dims.dp]), batch_size=BATCH // dims.dp, shuffle=False)

    def full(self) -> dict[str, torch.Tensor]:
        """Full weights by state-dict name (collective): DTensors gathered over tp, or ZeRO's gathered
        masters (stage 3 releases parameters between steps)."""
        if self.trainer.strategy.dims.tp > 1:
            with self.trainer.strategy.gathered_params():  # stage 3: gathered (a no-op below)
                return {f"model.{k}": v for k, v in full_weights(self.model).items()}
        names = {f"model.{n}" for n, _ in self.model.named_parameters()}
        return {k: v for k, v in self.trainer.strategy.full_state_dict().items() if k in names}

    def on_train_start(self) -> None:
        self.start = {"step": self.global_step, "weights": self.full()}
        if self.resave:
            self.trainer.save_checkpoint(self.resave)

    def on_train_epoch_end(self) -> None:
        if self.current_epoch == 0:
            self.saved_weights = self.full()


def _fit(opts: dict[str, str], module: CkptModule, ckpt_dir: str = "", ckpt_path: str | None = None) -> pl.Trainer:
    return fit_epochs(_strategy(opts), module, EPOCHS, CLIP, ckpt_dir, ckpt_path)


def _coords(trainer: pl.Trainer) -> dict:
    dims = trainer.strategy.dims
    return {"dp": dims.dp, "tp": dims.tp, "dp_rank": dims.dp_rank, "tp_rank": dims.tp_rank}


def run(name: str, spec: str, out: str) -> None:
    kind, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    pl.seed_everything(0)
    if kind == "save":
        module = CkptModule()
        trainer = _fit(opts, module, ckpt_dir=os.path.join(out, name))
        result = {"losses": module.step_losses, "saved_weights": module.saved_weights}
        save_result(result, _coords(trainer), out, name)
    elif kind == "resume":
        module = CkptModule(resave=os.path.join(out, f"{name}.ckpt"))
        trainer = _fit(opts, module, ckpt_path=os.path.join(out, opts["ckpt"]))
        result = {"losses": module.step_losses, "start": module.start}
        save_result(result, _coords(trainer), out, name)
    elif kind == "mismatch":
        rank = int(os.environ.get("RANK", "0"))
        try:
            _fit(opts, CkptModule(intermediate=96), ckpt_path=os.path.join(out, opts["ckpt"]))
            got = {"error": None}
        except Exception as e:  # noqa: BLE001 - the test reads which error every rank got
            got = {"error": type(e).__name__, "message": str(e), "losses": None}
        save_atomic(got, os.path.join(out, f"{name}.pt" if rank == 0 else f"{name}.rank{rank}.pt"))
    elif kind == "fabric":
        run_fabric(name, opts, out)
    else:
        raise ValueError(f"unknown spec {spec!r}")


def run_fabric(name: str, opts: dict[str, str], out: str) -> None:
    """Fabric's door on the same format: load a Trainer checkpoint into a TP module, save it again."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(opts, lightning_zero.ZeroFabricStrategy),
                    precision="32-true")
    fabric.launch()
    model = build("llama")
    tp = fabric.strategy.device_mesh["tp"]
    if tp.size() > 1:
        parallelize_module(model, tp, tp_plan_llama(model, tp))
    wrapper = torch.nn.Module()
    wrapper.model = model  # the Trainer's checkpoint names weights "model.*" (CkptModule.model)
    wrapper, opt = fabric.setup(wrapper, torch.optim.AdamW(wrapper.parameters(), lr=LR, weight_decay=0.1))
    state = {"model": wrapper, "optimizer": opt}
    rest = fabric.load(os.path.join(out, opts["ckpt"]), state)
    weights = {f"model.{k}": v for k, v in full_weights(model).items()}
    fabric.save(os.path.join(out, f"{name}.ckpt"), {"model": wrapper, "optimizer": opt, "step": rest.get("global_step")})
    save_result({"weights": weights}, {"tp": fabric.strategy.dims.tp}, out, name)



@scenario("parallel.tp_ckpt")
def runs(ctx: ScenarioContext) -> None:
    run_specs(run, ctx)
