"""One Trainer run of a checkpoint test worker: CPU, every rank of the launch, a ModelCheckpoint at every
epoch end when ``ckpt_dir`` is given, resumed from ``ckpt_path`` when that is."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


def fit_epochs(strategy: Any, module: pl.LightningModule, epochs: int, clip: float, ckpt_dir: str = "",
               ckpt_path: Optional[str] = None) -> pl.Trainer:
    """Train ``module`` for ``epochs`` epochs, fp32, clipping at ``clip``; the launch's WORLD_SIZE processes."""
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=epochs,
        gradient_clip_val=clip, logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, precision="32-true",
        use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer
