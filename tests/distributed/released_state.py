"""Scenario ``distributed.released_state``: what ``state_dict()`` and ``load_state_dict()`` do on a model whose
ZeRO-3 parameters are released (zero/released_guard.py [Note: released modules refuse, they do not return empty
tensors]). Before the guard, ``torch.save(model.state_dict(), ...)`` after fit wrote zero-byte tensors without
complaint and the file failed only when loaded ("Trying to resize storage that is not resizable").

Each rank returns the errors (or None) of every call below, and whether the fixes the errors name give the weights.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_zero import ZeroStrategy
from tests.helpers.parity_model import ParityNet


def _error(fn: Any) -> Optional[str]:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


class SavesEachEpoch(Callback):
    """A user's callback saving the weights at an epoch's end, between steps (units released)."""

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save(pl_module.state_dict(), io.BytesIO())


def _trainer(spec: str, callbacks: list[Callback], steps: int = 2) -> Trainer:
    offload = {"offload_optimizer": "cpu", "offload_params": "cpu"} if spec == "zero3_offload" else {}
    return Trainer(
        accelerator="cpu", devices=2, max_steps=steps, limit_train_batches=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0, callbacks=callbacks,
        strategy=ZeroStrategy(stage=3, param_persistence_threshold=0, **offload),
    )


def run(spec: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = ParityNet(checkpointing=False)
    trainer = _trainer(spec, [])
    trainer.fit(model)
    out: dict[str, Any] = {
        "state_dict": _error(lambda: torch.save(model.state_dict(), io.BytesIO())),
        "block_state_dict": _error(lambda: model.blocks[0].state_dict()),
        "keep_vars_names": sorted(model.state_dict(keep_vars=True)),  # names only: the strategy's own readers
    }
    full = trainer.strategy.full_state_dict()  # collective: the fix the error names
    out["full_keys"] = sorted(full)
    out["load_state_dict"] = _error(lambda: model.load_state_dict(full))
    with trainer.strategy.gathered_params():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    out["gathered_matches_full"] = all(torch.equal(inside[k], full[k].to(inside[k].dtype)) for k in full)
    shifted = {k: v + 1.0 if v.is_floating_point() else v for k, v in full.items()}
    with trainer.strategy.gathered_params(writeback=True):
        model.load_state_dict(shifted)
    after = trainer.strategy.full_state_dict()
    out["load_written_back"] = all(torch.allclose(after[k].float(), shifted[k].float()) for k in full)
    # during training: a callback saving weights between steps stops fit with the same error
    torch.manual_seed(0)
    again = ParityNet(checkpointing=False)
    out["callback"] = _error(lambda: _trainer(spec, [SavesEachEpoch()]).fit(again))
    return out
