"""Scenario ``moe.ckpt_ep`` (tests/helpers/harness.py): sharded checkpoints of expert-parallel runs, resumed at other EP sizes.

Runs ``{NAME: SPEC}`` (``run_worker``), SPEC

* ``save:stage=K,ep=E``: the MoE GPT of zero_ep_worker.py (E=4 experts, top-2, no dropping) under
  ZeroStrategy(stage=K, expert_parallel=E), 2 epochs of 2 fixed global batches (4 steps),
  ModelCheckpoint at each epoch's end into ``OUT/NAME`` (``epoch=0-step=2.ckpt`` is the one resumed);
  records every step's global loss (the uninterrupted run) and the weights at the end of epoch 0.
* ``resume:stage=K,ep=E,ckpt=REL``: the same run resumed from ``OUT/REL`` (whatever EP wrote it); at
  ``on_train_start`` it records the weights as loaded and saves them again into ``OUT/NAME.ckpt`` (the
  state as loaded, for the test to consolidate), then trains steps 2-3. Under EP > 1 it also records
  what the full format (``full_state_dict()``) says.
* ``fabric:stage=K,ep=E,ckpt=REL``: Fabric's door: ``fabric.load`` of ``OUT/REL`` into an EP-E module
  and its optimizer, the weights recorded, ``fabric.save`` into ``OUT/NAME.ckpt``.
* ``oracle:ckpt=REL`` (rank 0 alone, no strategy): ``OUT/REL`` consolidated (``load_consolidated``) into
  the single-process model of all experts and a plain ``torch.optim.AdamW``, which train steps 2-3 as
  zero_ep_worker's oracle does (the N ranks' micro-batches one after another): one process resumes.

Weights are recorded in the single-process naming (every rank's experts by global index, gathered),
under the LightingModule's names (``model.*``). Rank 0 writes ``OUT/NAME.pt`` (tests/helpers/worker_io.py).
"""

from __future__ import annotations

import os
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.fit_epochs import fit_epochs  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from lightning_zero.checkpoint import load_consolidated  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.moe.parallel import globalize_expert_state  # noqa: E402
from tests.helpers.worker_io import run_specs, save_atomic, save_result  # noqa: E402
from tests.helpers.harness import ScenarioContext, scenario  # noqa: E402
from tests.moe.zero_ep_worker import BATCH, CLIP, LR, MoEModule, config, loss_of, shard, tokens  # noqa: E402

TOP_K, BATCHES_PER_EPOCH, EPOCHS = 2, 2, 2


def _strategy(opts: dict[str, str], cls: type = lightning_zero.ZeroStrategy) -> object:
    return cls(stage=int(opts["stage"]), expert_parallel=int(opts.get("ep", "1")), bucket_size_mb=0.002,
               param_persistence_threshold=0, timeout_s=120.0)


def global_weights(model: torch.nn.Module, strategy: object) -> dict[str, torch.Tensor]:
    """Every rank's weights in the single-process naming, merged (collective)."""
    with strategy.gathered_params():  # type: ignore[attr-defined]  # stage 3 releases parameters between steps
        mine = globalize_expert_state({k: v.detach().clone() for k, v in model.state_dict().items()}, model)
    merged: dict[str, torch.Tensor] = {}
    for part in C.all_gather_object(mine, None):
        merged.update({f"model.{k}": v for k, v in part.items()})
    return merged


class CkptModule(MoEModule):
    """zero_ep_worker's module over 2 fixed global batches per epoch; records losses by global step and
    the weights at given moments (collectives: every rank records)."""

    def __init__(self, ep: int, resave: str = "") -> None:
        super().__init__(TOP_K, ep)
        self.resave = resave
        self.step_losses: dict[int, float] = {}
        self.saved_weights: dict[str, torch.Tensor] = {}
        self.start: dict = {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.step_losses[self.global_step] = self.losses[-1]
        return loss

    def train_dataloader(self):
        world, rank = C.world_size(), C.rank()
        rows = torch.cat([shard(tokens(), k, rank, world) for k in range(BATCHES_PER_EPOCH)])
        return DataLoader(TensorDataset(rows), batch_size=BATCH // world, shuffle=False)

    def on_train_start(self) -> None:
        self.start = {"step": self.global_step, "weights": global_weights(self.model, self.trainer.strategy)}
        if self.resave:
            self.trainer.save_checkpoint(self.resave)

    def on_train_epoch_end(self) -> None:
        if self.current_epoch == 0:
            self.saved_weights = global_weights(self.model, self.trainer.strategy)


def _fit(opts: dict[str, str], module: CkptModule, ckpt_dir: str = "", ckpt_path: str | None = None) -> pl.Trainer:
    return fit_epochs(_strategy(opts), module, EPOCHS, CLIP, ckpt_dir, ckpt_path)


def _coords(strategy: object) -> dict:
    dims = strategy.dims  # type: ignore[attr-defined]
    return {"ep": dims.ep, "ep_rank": dims.ep_rank, "edp_rank": dims.edp_rank}


def run(name: str, spec: str, out: str) -> None:
    kind, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    pl.seed_everything(0)
    ep = int(opts.get("ep", "1"))
    if kind == "save":
        module = CkptModule(ep)
        trainer = _fit(opts, module, ckpt_dir=os.path.join(out, name))
        save_result({"losses": module.step_losses, "saved_weights": module.saved_weights}, _coords(trainer.strategy),
                    out, name)
    elif kind == "resume":
        module = CkptModule(ep, resave=os.path.join(out, f"{name}.ckpt"))
        trainer = _fit(opts, module, ckpt_path=os.path.join(out, opts["ckpt"]))
        mine = _coords(trainer.strategy)
        if ep > 1:
            try:
                trainer.strategy.full_state_dict()
            except NotImplementedError as e:
                mine["full_refused"] = str(e)
        save_result({"losses": module.step_losses, "start": module.start}, mine, out, name)
    elif kind == "fabric":
        run_fabric(name, opts, out)
    elif kind == "oracle":
        if C.rank() == 0:
            save_atomic(run_oracle(os.path.join(out, opts["ckpt"]), C.world_size()), os.path.join(out, f"{name}.pt"))
    else:
        raise ValueError(f"unknown spec {spec!r}")


def run_fabric(name: str, opts: dict[str, str], out: str) -> None:
    """Fabric's door on the same format: load a Trainer checkpoint into an EP module, save it again."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                    strategy=_strategy(opts, lightning_zero.ZeroFabricStrategy), precision="32-true")
    fabric.launch()
    wrapper = torch.nn.Module()
    wrapper.model = GPT(config(TOP_K), ep_size=int(opts["ep"]))  # "model.*", as CkptModule names its weights
    wrapper, opt = fabric.setup(wrapper, torch.optim.AdamW(wrapper.parameters(), lr=LR, weight_decay=0.1))
    rest = fabric.load(os.path.join(out, opts["ckpt"]), {"model": wrapper, "optimizer": opt})
    weights = global_weights(wrapper.model, fabric.strategy)
    fabric.save(os.path.join(out, f"{name}.ckpt"), {"model": wrapper, "optimizer": opt, "step": rest.get("global_step")})
    save_result({"weights": weights}, _coords(fabric.strategy), out, name)


def run_oracle(path: str, world: int) -> dict:
    """One process resumes a consolidated checkpoint with plain torch (see the module docstring)."""
    ckpt = load_consolidated(path)
    model = GPT(config(TOP_K))
    model.load_state_dict({k[len("model."):]: v for k, v in ckpt["state_dict"].items()})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    data, losses = tokens(), {}
    for step in range(ckpt["global_step"], EPOCHS * BATCHES_PER_EPOCH):
        total = 0.0
        for r in range(world):
            loss = loss_of(model, shard(data, step % BATCHES_PER_EPOCH, r, world)) / world
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses[step] = total
    return {"losses": losses, "names": list(ckpt["state_dict"]),
            "single_process_names": [f"model.{k}" for k in GPT(config(TOP_K)).state_dict()]}



@scenario("moe.ckpt_ep")
def runs(ctx: ScenarioContext) -> None:
    run_specs(run, ctx)
