"""What a run did, written to the run directory's log files (Hydra's ``<job name>.log``, one per rank).

Why this exists: Hydra's job logging gives every process a file handler on the root logger
(``train.log`` for rank 0, ``train_ddp_process_<r>.log`` for the ranks Lightning re-launches), but
Lightning's loggers print through their own handlers and do not propagate to the root, and the
example logged nothing itself: every file stayed empty.
Now each rank's file holds Lightning's messages of that rank (distributed init, seed, why fit stopped)
and lightning_zero's (checkpoint saves), and rank 0's also the run's outline from :class:`RunLog`:
what was trained, how, each validation result, where the checkpoints are. The file handler opens
lazily (``delay: true`` in ``conf/config.yaml``), so a process with nothing to say leaves no file.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_zero.pipeline import PipelineModule

log = logging.getLogger("train")
"""The example's own logger (the script runs as ``__main__``, so it is named explicitly)."""

LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
"""Loggers that Lightning keeps from propagating to the root when it is imported before logging is
configured (they print with their own handlers); the standalone packages' names too (Lightning's
``rank_zero_info`` logs through ``pytorch_lightning``'s logger once that package is imported)."""


def share_file_handlers() -> None:
    """Give Lightning's loggers the root logger's file handlers, so their messages reach the run's log
    file too (not the console handler: Lightning already prints there). Idempotent."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if logger.propagate:
            continue  # reaches the root's handlers already
        for handler in files:
            if handler not in logger.handlers:
                logger.addHandler(handler)


LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
"""torch 2.13 deprecates what Lightning 2.6's ``utilities/_pytree.py`` still does on every batch: Lightning's
to fix, nothing a user can act on, printed once per process."""
LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"
"""Lightning's advertisement for its hosted logger, printed at every Trainer construction."""


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix`` (and nothing else)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_lightning() -> None:
    """Silence two lines of Lightning's that say nothing about this run, each by its own text through
    Python's documented switches (``warnings.filterwarnings`` for a message, a ``logging.Filter`` on the
    logger that prints it); every other warning and message stays. Idempotent. (Lightning's "Using bfloat16
    Automatic Mixed Precision (AMP)" does not print at all: train.py hands the Trainer ZeroPrecision as a
    plugin, which is not AMP: 16-bit weights and fp32 masters.)"""
    import warnings

    warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING)
    for name in ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(LITLOGGER_TIP))


class RunLog(Callback):
    """Rank 0 logs the run's outline: model and strategy at the start, every validation result, the
    end (steps done, where the last checkpoint is)."""

    def __init__(self) -> None:
        super().__init__()
        self._window: Optional[tuple[float, int, int]] = None
        """(start time, step at start, tokens since) of the current tokens/s window."""

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        model = getattr(pl_module, "model", pl_module)
        params = sum(p.numel() for p in pl_module.parameters())
        where = " in this pipeline stage" if isinstance(model, PipelineModule) else ""
        config = getattr(pl_module, "config", None)
        experts, ep = getattr(config, "moe_experts", 0), getattr(pl_module, "expert_parallel", 1)
        if experts and ep > 1:  # expert parallelism: the module holds this rank's experts only
            where = f" on this rank, which holds {experts // ep} of the {experts} experts of each MoE layer"
        flops = getattr(pl_module, "flops_per_token", None)
        per_token = f", {flops / 1e6:.3g} MFLOP per token (forward + backward)" if flops else ""
        log.info(
            "fit: %s (%s parameters%s%s), strategy %s, %d process(es) on %s, precision %s, max_steps %s",
            type(model).__name__, f"{params:,}", where, per_token, type(trainer.strategy).__name__, trainer.world_size,
            type(trainer.accelerator).__name__.replace("Accelerator", "").lower(), trainer.precision,
            trainer.max_steps,
        )

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Every ``log_every_n_steps`` optimizer steps: the train loss (rank 0's) and tokens/s of all
        data-parallel ranks together since the previous line (the first window starts at the first step's end,
        so start-up is not counted; a window with a validation in it counts the validation's time)."""
        if not trainer.is_global_zero:
            return
        now = time.perf_counter()
        if self._window is None:
            self._window = (now, trainer.global_step, 0)
        start, first_step, tokens = self._window
        split = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        tokens += int(getattr(x, "numel", lambda: 0)()) * int(split.get("num_replicas", 1))
        self._window = (start, first_step, tokens)
        step = trainer.global_step
        if step == first_step or step % max(1, trainer.log_every_n_steps):
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        log.info("step %d: train/loss %.4f, %s tokens/s", step, float(loss), f"{tokens / max(now - start, 1e-9):,.0f}")
        self._window = (now, step, 0)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())) or "no metrics"
        log.info("step %d: %s", trainer.global_step, shown)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        ckpt: Any = trainer.checkpoint_callback
        last = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")
        log.info("trained %d steps (%d epochs); last checkpoint: %s", trainer.global_step,
                 trainer.current_epoch, last or "none")
