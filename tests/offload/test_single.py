"""One-rank runs: 16-bit offload paths, the delayed update's exact semantics, memory against the estimator."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.offload import estimator as est
from tests.helpers.memory import storage_bytes
from tests.offload.helpers import fit, rel


@pytest.mark.parametrize("stage,offload", [
    (2, dict(offload_optimizer="cpu")),
    (3, dict(offload_optimizer="cpu", offload_params="cpu")),
    (3, dict(offload_optimizer="nvme", offload_params="nvme", nvme_chunk_mb=0.004)),
    (3, dict(offload_optimizer="nvme", offload_params="cpu", nvme_chunk_mb=0.004, nvme_fraction=0.5)),
])
def test_bf16_offload_follows_the_device_run(tmp_path: Path, stage: int, offload: dict) -> None:
    """bf16: the CPU Adam op writes the 16-bit copy itself (into the pinned partitions for stage 3 + cpu)."""
    if offload.get("offload_optimizer") == "nvme":
        offload["nvme_path"] = str(tmp_path)
    t, model = fit(steps=6, precision="bf16-mixed", stage=stage, **offload)
    if offload.get("offload_params") == "cpu":
        assert t.strategy.engines[0]._uploads == [[] for _ in t.strategy.engines[0].groups]  # no separate copy
    _, ref = fit(steps=6, precision="bf16-mixed", stage=stage)
    assert model.losses[0] == ref.losses[0]
    assert rel(model.losses, ref.losses) < 2e-2  # fp32 math differs in rounding; bf16 parameters may flip


class Recorder(pl.Callback):
    """Device parameters at each step's start; fp32 masters after each step (stage 2, one rank)."""

    def __init__(self) -> None:
        self.params: dict[int, torch.Tensor] = {}
        self.masters: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.params[trainer.global_step] = torch.cat([fg.flat_param.clone() for fg in trainer.strategy.engines[0].groups])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.engines[0]
        with engine.host_state():  # waits for the background step
            self.masters[trainer.global_step] = torch.cat([fg.master.clone() for fg in engine.groups])


@pytest.mark.parametrize("warmup", [0, 2])
def test_delayed_update_uses_parameters_one_update_old(warmup: int) -> None:
    """Step k runs on the parameters after k updates while synchronous, after k - 1 once delayed."""
    rec = Recorder()
    fit(steps=7, callbacks=[rec], stage=2, offload_optimizer="cpu", delayed_param_update=True,
        delayed_param_update_warmup=warmup)
    # rec.params[k]: parameters step k ran on; rec.masters[s]: fp32 masters after s updates
    for k in range(1, 7):
        source = k if k <= warmup else k - 1
        if source >= 1:
            assert torch.equal(rec.params[k], rec.masters[source]), k
        if k > warmup:
            assert not torch.equal(rec.params[k], rec.masters[k]), k  # one update old


# ---------------------------------------------------------------------------------------- memory vs estimator
class Wide(pl.LightningModule):
    """~0.9M parameters in six units (large against the 4 KiB buffer alignment)."""

    def __init__(self, d: int = 384, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = torch.tanh(block(x))
        loss = (x.float() - y).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 384, generator=g), torch.randn(64, 384, generator=g)), batch_size=8)


class HostBytes(pl.Callback):
    """Storage of every host-side offload tensor after a step, and of the swap files."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        e = trainer.strategy.engines[0]
        host = [fg.master for fg in e.groups]
        host += [v for st in trainer.optimizers[0].state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        host += [t for hg in e._grads for t in [hg.landing, hg.acc, *hg.spares] if t is not None]
        host += [t for ups in e._uploads for t in ups]
        if e.offload.offload_params == "cpu":
            host += [fg.shard16 for fg in e.groups]
        for store in (e._opt_store, getattr(e, "_param_store", None)):  # the NVMe stores' read-ahead rings
            if store is not None:
                host += [slot.arena for slot in store.ring.slots if slot.arena is not None]
        self.host = storage_bytes(host)
        swap = e.swap_dir()
        self.nvme = sum(p.stat().st_size for p in Path(swap).glob("*.swap")) if swap else 0
        self.params = sum(p.numel() for p in pl_module.parameters())


@pytest.mark.parametrize("stage,offload", [
    (2, dict(offload_optimizer="cpu")),
    (3, dict(offload_optimizer="cpu", offload_params="cpu")),
    (3, dict(offload_optimizer="nvme", offload_params="nvme", nvme_chunk_mb=0.25)),
])
def test_host_and_nvme_memory_within_15_percent_of_the_estimate(tmp_path: Path, stage: int, offload: dict) -> None:
    if offload["offload_optimizer"] == "nvme":
        offload["nvme_path"] = str(tmp_path)
    probe = HostBytes()
    pl.seed_everything(0)
    fit(steps=2, callbacks=[probe], model=Wide(), precision="bf16-mixed", stage=stage, **offload)
    setting = est.Setting(stage, offload["offload_optimizer"], offload.get("offload_params", "none"))
    w = est.Workload(probe.params, largest_unit=384 * 385, nvme_chunk_numel=int(offload.get("nvme_chunk_mb", 1) * 2**18))
    e = est.estimate(setting, w)
    assert abs(probe.host - e.cpu_bytes) <= 0.15 * e.cpu_bytes, (probe.host, e.cpu_bytes)
    assert abs(probe.nvme - e.nvme_bytes) <= 0.15 * max(e.nvme_bytes, 1), (probe.nvme, e.nvme_bytes)


def test_registered_names_just_work() -> None:
    import lightning_zero  # noqa: F401  (registers the names)
    from tests.helpers.parity_model import ParityNet

    pl.seed_everything(0)
    model = ParityNet()
    trainer = pl.Trainer(strategy="zero3_offload", accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(model)
    cfg = trainer.strategy.config
    assert (cfg.stage, cfg.offload_optimizer, cfg.offload_params) == (3, "cpu", "cpu") and len(model.losses) == 2


class EditInPlace(pl.Callback):
    """User code changes a weight through ``gathered_params(writeback=True)`` between steps."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        weight = pl_module.blocks[0].up.weight
        with trainer.strategy.gathered_params(pl_module.blocks[0], writeback=True):
            weight.data.fill_(0.25)
        with trainer.strategy.gathered_params(pl_module.blocks[0]):
            self.seen = weight.detach().clone()
        with trainer.strategy.engines[0].host_state():
            self.state = trainer.strategy.full_state_dict()


def test_gathered_params_writeback_reaches_the_swap_files(tmp_path: Path) -> None:
    cb = EditInPlace()
    fit(steps=3, callbacks=[cb], stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    assert torch.all(cb.seen == 0.25)
    assert torch.all(cb.state["blocks.0.up.weight"] == 0.25)
