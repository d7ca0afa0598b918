"""``FlopsProfiler``: DeepSpeed's flops profiler as a Lightning callback.

On the first training batch of optimizer step ``profile_step`` it hooks every module of the
LightningModule and counts the ops that run (flops.py, modules.py) from ``on_train_batch_start`` to
``on_train_batch_end`` (forward, backward, optimizer step), then removes every hook: other steps pay
nothing. The device is synchronised at both ends of the profiled batch only, so the step time is the
batch's. Rank 0 prints the report through the progress bar (so the bar stays readable); every rank
that is its pipeline stage's first data-parallel rank writes its report to the run directory
(``flops_profile.txt``, ``flops_profile_stage<k>.txt`` under pipeline stages); the model totals go
to the loggers as ``profiler/*`` (per stage as ``profiler/stage<k>/*``). Under several ranks the
totals are all-gathered once (a collective every rank enters, at the same batch).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_zero.logging.metrics import peak_bf16_flops
from lightning_zero.profiler.modules import ModuleProfiler, ProfileResult
from lightning_zero.profiler.report import StepTotals, render


class FlopsProfiler(Callback):
    """Profile one training step: per-module parameters, forward FLOPs/MACs, forward and backward
    latency, and the model's FLOPs per step, TFLOP/s and MFU.

    Args:
        profile_step: the optimizer step (``trainer.global_step``) to profile; its first batch is profiled.
        module_depth: depth of the printed tree (-1: every module; the file always has every module).
        top_modules: per depth, how many modules to list by FLOPs, parameters and latency.
        output_file: report file name in the run directory (``trainer.log_dir``); None writes none.
        peak_flops: the device's peak FLOP/s for MFU; None: the dense bf16 peak of the device
            (report.py [Note: the peak behind MFU]).
        print_report: print the report on rank 0.
    """

    def __init__(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        output_file: Optional[str] = "flops_profile.txt",
        peak_flops: Optional[float] = None,
        print_report: bool = True,
    ) -> None:
        super().__init__()
        if profile_step < 0:
            raise ValueError(f"profile_step must be >= 0, got {profile_step}.")
        self.profile_step = profile_step
        self.module_depth = module_depth
        self.top_modules = top_modules
        self.output_file = output_file
        self.peak_flops = peak_flops
        self.print_report = print_report
        self.result: Optional[ProfileResult] = None
        """This rank's per-module result, once the step is profiled."""
        self.totals: Optional[StepTotals] = None
        """This rank's totals (its pipeline stage's, under pipeline stages)."""
        self.model_totals: Optional[StepTotals] = None
        """The whole model's totals (all stages of one data-parallel replica)."""
        self.report: Optional[str] = None
        self.report_path: Optional[str] = None
        self._profiler: Optional[ModuleProfiler] = None
        self._t0 = 0.0
        self._step = 0
        self._done = False

    def _sync(self, pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._done or self._profiler is not None or trainer.global_step != self.profile_step:
            return
        self._sync(pl_module)
        self._profiler = ModuleProfiler(pl_module, pl_module.device).start()
        self._step = trainer.global_step
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None:
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._t0
        result = self._profiler.stop()
        self._profiler = None
        self._done = True
        self.result = result
        peak = self.peak_flops
        if peak is None and pl_module.device.type == "cuda":
            peak = peak_bf16_flops(torch.cuda.get_device_name(pl_module.device))
        self.totals = StepTotals(result.params, result.fwd_flops, result.bwd_flops, elapsed, peak)
        stage, stages, replica = self._layout(trainer)
        rows = self._gather(trainer, pl_module, stage, replica, self.totals)
        per_stage = sorted((s, t) for s, r, t in rows if r == 0)
        self.model_totals = StepTotals(
            sum(t.params for _, t in per_stage), sum(t.fwd_flops for _, t in per_stage),
            sum(t.bwd_flops for _, t in per_stage), max(t.step_time_s for _, t in per_stage), peak,
        )
        title = f"FlopsProfiler: step {self._step}, batch {batch_idx}, rank {trainer.global_rank}" + (
            f", pipeline stage {stage} of {stages}" if stages > 1 else "")
        self.report = render(result, self.totals, title, -1, self.top_modules, per_stage if stages > 1 else None)
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast under several ranks: every rank asks
        if self.output_file and replica == 0:
            name = self.output_file
            if stages > 1:
                root, ext = os.path.splitext(name)
                name = f"{root}_stage{stage}{ext}"
            os.makedirs(log_dir, exist_ok=True)
            self.report_path = os.path.join(log_dir, name)
            with open(self.report_path, "w") as f:
                f.write(self.report)
        if trainer.is_global_zero:
            if self.print_report:
                shown = render(result, self.totals, title, self.module_depth, self.top_modules,
                               per_stage if stages > 1 else None)
                bar = trainer.progress_bar_callback
                (bar.print if bar is not None else print)(shown)
            metrics = self.model_totals.metrics()
            if stages > 1:
                for s, t in per_stage:
                    metrics.update(t.metrics(f"profiler/stage{s}/"))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._step)

    @staticmethod
    def _layout(trainer: Trainer) -> tuple[int, int, int]:
        """(this rank's pipeline stage, number of stages, data-parallel replica index)."""
        dims = getattr(trainer.strategy, "dims", None)
        if dims is not None and getattr(dims, "pp", 1) > 1:
            return int(dims.pp_rank), int(dims.pp), int(dims.dp_rank)
        return 0, 1, int(trainer.global_rank)

    @staticmethod
    def _gather(
        trainer: Trainer, pl_module: LightningModule, stage: int, replica: int, totals: StepTotals
    ) -> list[tuple[int, int, StepTotals]]:
        """(stage, replica, totals) of every rank (one all-gather; just this rank's alone)."""
        mine = [(stage, replica, totals)]
        if trainer.world_size <= 1:
            return mine
        row = torch.tensor([stage, replica, totals.params, totals.fwd_flops, totals.bwd_flops, totals.step_time_s],
                           dtype=torch.float64, device=pl_module.device)
        rows = trainer.strategy.all_gather(row).reshape(-1, 6).cpu().tolist()
        return [(int(r[0]), int(r[1]), StepTotals(int(r[2]), int(r[3]), int(r[4]), float(r[5]), totals.peak_flops))
                for r in rows]


__all__ = ["FlopsProfiler"]
