"""``MoEMetrics``: a Lightning callback logging what the Mixture-of-Experts layers routed (issue #20):
the auxiliary load-balancing loss, the tokens each expert was asked to take and the fraction of
assignments dropped by the capacity.

Why a callback: the numbers live in the layers (``MoE.aux_loss``, ``MoE.last_stats``) and must reach
any logger under any strategy (``ddp`` included), like ZeroMetrics' numbers. Every ``log_every_n_steps``
optimizer steps it reads the layers' statistics of the step's last micro-batch on each rank, sums them
over all ranks in *one* all-reduce (a rank routes only its own tokens; with expert parallelism the
counts are still per global expert), and logs:

* ``moe/aux_loss``: the auxiliary loss added to the training loss (sum over layers, already scaled by
  each layer's ``aux_loss_coef``), mean over ranks;
* ``moe/dropped_fraction``: dropped assignments / all assignments, mean over layers and ranks;
* ``moe/<layer>/dropped_fraction`` and ``moe/<layer>/tokens_expert<e>``: per layer; the token counts
  are assignments before capacity (the routing demand), summed over ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_zero.moe.parallel import moe_layers


class MoEMetrics(Callback):
    """Log MoE routing statistics every ``log_every_n_steps`` optimizer steps (None: the trainer's)."""

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self.last: dict[str, float] = {}
        """The metrics last logged (every rank has them; tests read them)."""

    def _every(self, trainer: Trainer) -> int:
        return max(1, int(self.log_every_n_steps or trainer.log_every_n_steps))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step % self._every(trainer) != 0 or getattr(self, "_logged_step", None) == step:
            return  # before the first step, mid-accumulation, or not a logging step
        self._logged_step = step
        layers = [(name, layer) for name, layer in moe_layers(pl_module) if layer.last_stats is not None]
        if not layers:
            return
        metrics = self.collect(trainer, layers)
        self.last = metrics
        log_step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=log_step)

    @staticmethod
    def collect(trainer: Trainer, layers: list) -> dict[str, float]:
        """The metrics of ``layers`` ((name, MoE) pairs), summed over ranks in one collective."""
        parts = []
        for _, layer in layers:
            stats = layer.last_stats
            aux = layer.aux_loss.detach().float().reshape(1) if layer.aux_loss is not None else torch.zeros(1)
            parts += [stats.expert_counts.float().cpu(), stats.dropped_fraction.float().cpu().reshape(1), aux.cpu()]
        flat = torch.cat(parts)
        strategy = trainer.strategy
        device = getattr(strategy, "root_device", torch.device("cpu"))
        summed = strategy.reduce(flat.to(device), reduce_op="sum").cpu() if trainer.world_size > 1 else flat
        world = float(trainer.world_size)
        metrics: dict[str, float] = {}
        offset, aux_total, dropped_total = 0, 0.0, 0.0
        for name, layer in layers:
            key = name.removeprefix("model.")
            counts = summed[offset : offset + layer.num_experts]
            dropped = float(summed[offset + layer.num_experts]) / world
            aux = float(summed[offset + layer.num_experts + 1]) / world
            offset += layer.num_experts + 2
            for e, c in enumerate(counts.tolist()):
                metrics[f"moe/{key}/tokens_expert{e}"] = c
            metrics[f"moe/{key}/dropped_fraction"] = dropped
            aux_total += aux
            dropped_total += dropped
        metrics["moe/aux_loss"] = aux_total
        metrics["moe/dropped_fraction"] = dropped_total / len(layers)
        return metrics
