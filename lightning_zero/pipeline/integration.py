"""What ZeroStrategy calls when ``pipeline_stages > 1``; the strategy keeps no pipeline logic.

Reading order (the strategy's lifecycle):

1. ``setup_environment`` -> :meth:`PipelineIntegration.place`: every PipelineModule already in the
   LightningModule is placed on this rank's stage, building only its layers (before Lightning's
   hooks walk the module and would build all of them).
2. ``setup``, before the model moves to the device -> :meth:`prepare`: place modules created in
   ``configure_model``, check the LightningModule, create the tied-layer groups and make tied copies
   equal. Then the strategy moves the model, makes data-parallel replicas equal, calls
   ``configure_optimizers`` (which sees only this stage's parameters) and builds its engines.
3. end of ``setup`` -> :meth:`attach`: count tied copies once in the gradient norm, attach a
   :class:`PipelineRuntime` to the PipelineModule. From then on ``pipe((inputs, labels))`` runs
   the schedule.
4. checkpoints -> :meth:`merge_state_dict`, :meth:`gather_optimizer_state`,
   :meth:`local_optimizer_state` (pipeline/checkpoint.py); data -> :meth:`check_dataloader`;
   metrics -> :attr:`bubble`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_zero.comm import collectives as C
from lightning_zero.config import ZeroConfig
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.pipeline import checkpoint as ckpt
from lightning_zero.pipeline.module import PipelineModule, find_pipeline_modules
from lightning_zero.pipeline.runtime import PipelineRuntime
from lightning_zero.pipeline.schedule import theoretical_bubble
from lightning_zero.pipeline.tied import (
    EngineGradSync, TiedCopy, broadcast_tied_weights, build_tied_copies, count_tied_once,
)
from lightning_zero.zero.engine import ZeroEngine


class PipelineIntegration:
    """Pipeline parallelism for one ZeroStrategy run (``config.pipeline_stages > 1``)."""

    def __init__(self, config: ZeroConfig, dims: ParallelDims, device: torch.device) -> None:
        if config.stage >= 2:  # also rejected by ZeroConfig.validate; kept for configs built by hand
            raise ValueError(f"pipeline_stages > 1 needs ZeRO stage 0 or 1, got stage {config.stage}.")
        self.config = config
        self.dims = dims
        self.device = device
        self.chunks = config.virtual_stages if config.schedule == "interleaved" else 1
        self.pipe: Optional[PipelineModule] = None
        self.copies: list[TiedCopy] = []
        self.runtime: Optional[PipelineRuntime] = None

    # ------------------------------------------------------------------------------- setup
    def _place_all(self, root: nn.Module) -> list[PipelineModule]:
        pipes = [p for _, p in find_pipeline_modules(root)]
        if len(pipes) > 1:
            names = [n for n, _ in find_pipeline_modules(root)]
            raise ValueError(f"pipeline_stages > 1 supports one PipelineModule per LightningModule; found {names}.")
        for pipe in pipes:
            pipe.materialize(self.dims.pp_rank, self.dims.pp, self.chunks)
        return pipes

    def place(self, root: Optional[nn.Module]) -> None:
        """Build this stage's layers of the PipelineModules that exist already (setup_environment)."""
        if root is not None:
            self._place_all(root)

    def prepare(self, root: nn.Module) -> None:
        """Place, check and tie (strategy.setup, before the model moves to the device). Collective."""
        pipes = self._place_all(root)
        if not pipes:
            raise ValueError(
                f"pipeline_stages={self.dims.pp} needs the LightningModule to hold its layers in a "
                "lightning_zero.pipeline.PipelineModule (self.pipe = PipelineModule([...], loss_fn)) and to call "
                "self.pipe((inputs, labels)) in its steps."
            )
        pipe = pipes[0]
        inside = {id(p) for p in pipe.parameters()}
        outside = [n for n, p in root.named_parameters() if p.requires_grad and id(p) not in inside]
        if outside:
            raise ValueError(
                f"with pipeline_stages > 1 every trainable parameter must live in the PipelineModule; found "
                f"{outside[:5]}{' ...' if len(outside) > 5 else ''} outside it (freeze them or make them layers)."
            )
        self.pipe = pipe
        self.copies = build_tied_copies(pipe, self.dims, self.config.timeout_s)
        broadcast_tied_weights(pipe, self.copies, self.device)

    def attach(self, trainer: Any, engines: Sequence[ZeroEngine], loss_scale: Callable[[], Optional[float]]) -> None:
        """Attach the runtime (end of strategy.setup, after the engines exist). Collective."""
        assert self.pipe is not None, "prepare() first"
        # The first operation on a group must involve all its ranks (NCCL's rule for batched p2p).
        C.all_reduce(torch.zeros(1, device=C.device_for(self.dims.pp_group, self.device)), self.dims.pp_group)
        if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
            engines = []  # validate/test/predict: no backward (engines of an earlier fit are stale)
        if any(len(stages) > 1 for stages in self.pipe.tied_holders().values()):  # the same on every rank
            for engine in engines:
                count_tied_once(engine, self.copies)

        def grad_scale() -> float:
            return float(loss_scale() or 1.0) / max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))

        self.runtime = PipelineRuntime(
            self.pipe,
            group=self.dims.pp_group,
            rank=self.dims.pp_rank,
            stages=self.dims.pp,
            chunks=self.chunks,
            schedule=self.config.schedule,
            microbatches=self.config.microbatches,
            device=self.device,
            grad_scale=grad_scale,
            grad_sync=EngineGradSync(engines, self.copies) if engines else None,
        )
        self.pipe.attach_runtime(self.runtime)

    def teardown(self) -> None:
        """Detach the runtime: the module runs its (local) layers in sequence again."""
        if self.pipe is not None:
            self.pipe.attach_runtime(None)

    # ------------------------------------------------------------------------------- data
    def check_dataloader(self, dataloader: object, training: bool) -> None:
        """Reject a training loader whose batches cannot be cut into equal micro-batches, before training."""
        if not training:
            return
        m = self.config.microbatches
        bs = getattr(dataloader, "batch_size", None)
        if not isinstance(bs, int):
            return  # a custom batch sampler: checked on every batch instead
        if bs % m != 0:
            raise ValueError(
                f"the training DataLoader's batch_size={bs} is not divisible by microbatches={m}: each batch is cut "
                f"into {m} equal micro-batches. Use a batch size that is a multiple of {m}, or change microbatches."
            )
        sampler = getattr(dataloader, "sampler", None)
        drop_last = bool(getattr(dataloader, "drop_last", False))
        try:
            n = len(sampler)  # type: ignore[arg-type]
        except TypeError:
            return
        last = n % bs
        if not drop_last and last % m != 0:
            raise ValueError(
                f"the training DataLoader's last batch has {last} samples ({n} per rank, batch_size={bs}), which is "
                f"not divisible by microbatches={m}: pass drop_last=True or make the dataset size per rank divide."
            )

    # ------------------------------------------------------------------------------- checkpoints
    def merge_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        return ckpt.merge_model_state(local, self.dims, self.device)

    def gather_optimizer_state(self, local: dict[str, Any]) -> dict[str, Any]:
        return ckpt.gather_optimizer_state(local, self.dims, self.device)

    def local_optimizer_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        return ckpt.local_optimizer_state(saved, self.dims)

    # ------------------------------------------------------------------------------- metrics
    @property
    def bubble(self) -> dict[str, Optional[float]]:
        """Theoretical bubble (P-1)/(M+P-1) (interleaved: (P-1)/(V M+P-1)) and the measured one over the
        last steps: ``measured`` (average stage) and ``measured_stage`` (this rank's stage)."""
        theory = theoretical_bubble(self.config.schedule, self.dims.pp, self.config.microbatches, self.chunks)
        if self.runtime is not None:
            self.runtime.collect_timing()
        stats = self.runtime.bubble if self.runtime is not None else None
        return {
            "theoretical": theory,
            "measured": stats.measured if stats is not None else None,
            "measured_stage": stats.measured_local if stats is not None else None,
        }


__all__ = ["PipelineIntegration"]
