"""In-process (one rank, CPU) training runs for the offload tests: quick, and callbacks can reach in."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl

from lightning_zero import ZeroStrategy
from tests.helpers.compare import max_rel
from tests.helpers.parity_model import ParityNet


def trainer(steps: int = 4, callbacks: Optional[list] = None, precision: str = "32-true", accumulate: int = 1,
            clip: Optional[float] = 0.5, accelerator: str = "cpu", plugins: Optional[list] = None,
            **strategy: Any) -> pl.Trainer:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    strategy.setdefault("bucket_size_mb", 0.002)
    if strategy.get("stage") == 3:
        strategy.setdefault("param_persistence_threshold", 0)
    return pl.Trainer(
        accelerator=accelerator, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        limit_val_batches=1, val_check_interval=3, num_sanity_val_steps=0, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip, precision=None if plugins else precision, plugins=plugins,
        callbacks=callbacks or [], strategy=ZeroStrategy(**strategy),
    )


def fit(steps: int = 4, callbacks: Optional[list] = None, model: Optional[pl.LightningModule] = None,
        **kwargs: Any) -> tuple[pl.Trainer, pl.LightningModule]:
    pl.seed_everything(0, workers=True)
    model = model or ParityNet()
    t = trainer(steps, callbacks, **kwargs)
    t.fit(model)
    return t, model


rel = max_rel  # the parity tests' one definition (tests/helpers/compare.py)
