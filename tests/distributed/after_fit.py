"""Scenario ``distributed.after_fit``: the module ``trainer.fit`` hands back under ``bf16-mixed`` (lightning_zero/
after_fit.py [Note: the module after fit]). Before it, the user's module kept its 16-bit training copy: saved
state dicts were rounded, and a second fit started its fp32 masters from the rounded values (ddp's continues from
its fp32 weights).

For each spec: fit 3 steps, then what the module holds (dtypes, devices, values against the masters), then
``validate`` (the module is set up in 16 bits again and handed back again), then a second fit with a new Trainer
whose masters are read when its training starts.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_zero import ZeroStrategy
from tests.helpers.launch import worker_accelerator
from tests.helpers.parity_model import ParityNet

SPECS: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
    "zero2_autocast": {"stage": 2, "mixed_precision": "autocast"},
    "zero3": {"stage": 3, "param_persistence_threshold": 0},
    "zero3_persistent": {"stage": 3},  # the default threshold: ParityNet's units stay gathered between steps
}


class MastersAtStart(Callback):
    """The fp32 masters when the second fit's training starts (collective: every rank is here), and the frozen
    Linear's weight the forward computes with (stages 0-2: the module's 16-bit copy)."""

    def __init__(self) -> None:
        self.masters: Optional[dict[str, torch.Tensor]] = None
        self.frozen_compute: Optional[torch.Tensor] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.masters = trainer.strategy.full_state_dict()
        weight = pl_module.frozen.weight
        self.frozen_compute = weight.detach().clone() if weight.untyped_storage().nbytes() else None


def _trainer(options: dict[str, Any], steps: int, callbacks: list[Callback]) -> Trainer:
    return Trainer(
        accelerator=worker_accelerator(), devices=int(os.environ["WORLD_SIZE"]), max_steps=steps,
        limit_train_batches=steps, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, precision="bf16-mixed", callbacks=callbacks,
        strategy=ZeroStrategy(bucket_size_mb=0.002, **options),
    )


def _held(model: torch.nn.Module) -> dict[str, Any]:
    params = dict(model.named_parameters())
    return {
        "param_dtypes": sorted({str(p.dtype) for p in params.values()}),
        "devices": sorted({t.device.type for t in [*params.values(), *model.buffers()]}),
        "buffer_dtypes": {k: str(b.dtype) for k, b in model.named_buffers()},
    }


def _resumed_frozen(spec: str, path: str, built: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A model whose frozen Linear holds other values resumes ``path``: the masters at its training start, the
    16-bit copy its forward uses and the module it gets back must hold the checkpoint's exact frozen values."""
    torch.manual_seed(1)
    model = ParityNet(checkpointing=False)
    assert not torch.equal(model.frozen.weight, built["weight"])
    probe = MastersAtStart()
    _trainer(SPECS[spec], 4, [probe]).fit(model, ckpt_path=path)
    assert probe.masters is not None
    out = {"masters": sorted(k for k, v in built.items() if torch.equal(probe.masters[f"frozen.{k}"], v))}
    if probe.frozen_compute is not None:  # stages 0-2: the forward's copy is the exact value, cast
        out["compute"] = torch.equal(probe.frozen_compute.cpu(), built["weight"].to(probe.frozen_compute.dtype))
    if not spec.startswith("zero3"):
        out["module"] = sorted(k for k, v in built.items() if torch.equal(model.frozen.state_dict()[k], v))
    return out


def run(spec: str, out_dir: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = ParityNet(checkpointing=False)
    built = {k: v.detach().clone() for k, v in model.frozen.state_dict().items()}  # the frozen Linear, fp32
    trainer = _trainer(SPECS[spec], 3, [])
    trainer.fit(model)
    masters = trainer.strategy.full_state_dict()  # collective
    out: dict[str, Any] = {"spec": spec, "masters_dtypes": sorted({str(v.dtype) for v in masters.values()})}
    # frozen_fp32.py: the frozen fp32 weights come back exactly as built (they compute in bf16 under the cast)
    out["frozen_masters_as_built"] = sorted(k for k, v in built.items() if torch.equal(masters[f"frozen.{k}"], v))
    kept = trainer.strategy._zero.frozen_fp32  # its host copy: this rank's share, counted by storage
    out["frozen_share_bytes"] = sum(s.values.untyped_storage().nbytes() for s in kept.shares.values()) if kept else 0
    out["frozen_fp32_bytes"] = sum(v.numel() * 4 for v in built.values())
    path = os.path.join(out_dir, f"{spec}.ckpt")
    trainer.save_checkpoint(path)  # sharded (the default format)
    out["frozen_resumed"] = _resumed_frozen(spec, path, built)
    if spec.startswith("zero3"):  # released parameters: refused, not handed back (test_released_state.py)
        try:
            model.state_dict()
            out["state_dict_error"] = None
        except RuntimeError as exc:
            out["state_dict_error"] = str(exc)
        return out
    out["after_fit"] = _held(model)
    out["frozen_module_as_built"] = sorted(k for k, v in built.items() if torch.equal(model.frozen.state_dict()[k], v))
    state = model.state_dict()
    out["equals_masters"] = sorted(k for k in masters if torch.equal(state[k], masters[k]))
    out["keys"] = sorted(masters)
    trainer.validate(model, verbose=False)
    out["after_validate"] = _held(model)
    out["equals_masters_after_validate"] = sorted(k for k, v in model.state_dict().items() if torch.equal(v, masters[k]))
    probe = MastersAtStart()
    _trainer(SPECS[spec], 1, [probe]).fit(model)
    assert probe.masters is not None
    out["second_fit_starts_from_masters"] = sorted(k for k in masters if torch.equal(probe.masters[k], masters[k]))
    out["frozen_after_second_fit"] = sorted(k for k, v in built.items() if torch.equal(model.frozen.state_dict()[k], v))
    return out
