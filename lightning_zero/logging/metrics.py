"""``ZeroMetrics``: a Lightning callback that logs learning rate, gradient norm, loss scale, throughput,
step time, peak memory, (on GPU) achieved TFLOP/s and MFU, (pipeline runs) the pipeline bubble and
(1-bit optimizers) compressed-communication statistics to the trainer's loggers.

Why a callback and not code in the strategy: the same numbers must come out of every strategy we compare
against (``ddp``, ``fsdp``, DeepSpeed), so the callback reads what a strategy offers through optional
attributes (``grad_norm``, ``loss_scale``, ``skipped_steps``, ``dims``, ``pipeline_bubble``) and what an
optimizer offers (``comm_stats``), and never requires them.

[Note: tokens per second] Tokens/s count each batch once: a rank's batch times the data-parallel
degree (``strategy.dims.dp``; without ``dims``, the world size). Under pipeline parallelism the stages
of one pipeline all see the same batch, so multiplying by the world size would count it once per stage.
TFLOP/s per device still divide by the world size: every device does a share of the total work.

[Note: timing windows] Step time and tokens/s are averaged over the ``log_every_n_steps`` steps since the
last log, measured with one device synchronisation per log (not per step, which would serialise the
CPU and GPU). Validation time inside a window is subtracted. The first window starts at the first
training batch, so it includes warm-up costs (allocator growth, kernel autotuning).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name(), dense bf16 tensor-core FLOP/s); first match wins,
    # so more specific names come first.
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)
"""Known peak dense bf16 FLOP/s by device name; MFU is reported against these."""

GIB = float(2**30)


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s of a device from its name, or None when it is not in the table."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def achieved_flops(flops_per_token: float, tokens_per_s: float, world_size: int) -> float:
    """FLOP/s achieved per device, from the global token rate (every device does an equal share)."""
    return flops_per_token * tokens_per_s / world_size


def data_parallel_size(trainer: Trainer) -> int:
    """Ranks that train on different batches: ``strategy.dims.dp`` when the strategy has it, else the
    world size (see [Note: tokens per second])."""
    dp = getattr(getattr(trainer.strategy, "dims", None), "dp", None)
    if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1:
        return dp
    return trainer.world_size


def _as_float(value: Any) -> Optional[float]:
    """A Python number or one-element tensor as a float; None for anything else (strings, None)."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return None


BUBBLE_KEYS = (
    ("theoretical", "pipeline/bubble_theoretical"),
    ("measured", "pipeline/bubble_measured"),
    ("measured_stage", "pipeline/bubble_measured_stage"),
)
"""``strategy.pipeline_bubble`` entry -> logged key."""


def pipeline_metrics(strategy: Any) -> dict[str, float]:
    """The pipeline bubble from ``strategy.pipeline_bubble`` (``{theoretical, measured, measured_stage}``,
    fractions of the step time; None entries, e.g. before the first measured step, are left out)."""
    bubble = getattr(strategy, "pipeline_bubble", None)
    if not isinstance(bubble, Mapping):
        return {}
    values = {name: _as_float(bubble.get(key)) for key, name in BUBBLE_KEYS}
    return {name: v for name, v in values.items() if v is not None and math.isfinite(v)}


def communication_metrics(optimizers: Sequence[Any]) -> dict[str, float]:
    """Compressed-communication statistics of optimizers that expose ``comm_stats`` (1-bit Adam/LAMB:
    bytes sent compressed vs. a 16-bit all-reduce of the same vector, the phase, ...).

    Keys are the optimizer's own when they carry a namespace (``onebit/bytes_sent``), else ``comm/<key>``;
    the second and later optimizers get a ``_opt<i>`` suffix. Non-numeric values are skipped.
    """
    out: dict[str, float] = {}
    for i, optimizer in enumerate(optimizers):
        stats = getattr(optimizer, "comm_stats", None)
        if not isinstance(stats, Mapping):
            continue
        suffix = f"_opt{i}" if i else ""
        for key, value in stats.items():
            number = _as_float(value)
            if number is not None and math.isfinite(number):
                name = str(key) if "/" in str(key) else f"comm/{key}"
                out[name + suffix] = number
    return out


def stage3_traffic(strategy: Any) -> dict[str, int]:
    """Bytes this rank's stage-3 engines have sent so far, by label (``param_gather``, ``grad_reduce``, ...;
    lightning_zero/zero/zeropp.py), summed over engines; empty for other strategies and stages."""
    out: dict[str, int] = {}
    for engine in getattr(strategy, "engines", None) or []:
        for label, nbytes in engine.bytes_sent().items():
            out[label] = out.get(label, 0) + int(nbytes)
    return out


def traffic_metrics(now: Mapping[str, int], before: Mapping[str, int], steps: int) -> dict[str, float]:
    """``comm/<label>_bytes_per_step``: what stage 3's gathers and reductions sent per optimizer step over a
    logging window (ZeRO++'s quantized collectives show up here as fewer bytes)."""
    if steps <= 0:
        return {}
    return {f"comm/{label}_bytes_per_step": (nbytes - before.get(label, 0)) / steps for label, nbytes in now.items()}


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the element count of its first tensor (the (batch, time) input ids)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        first = batch.get("input_ids", next(iter(batch.values()), None))
        return count_tokens(first)
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) > 0:
        return count_tokens(batch[0])
    raise TypeError(f"Cannot count tokens in a batch of type {type(batch).__name__}; pass tokens_per_batch=.")


def peak_host_rss_bytes() -> Optional[int]:
    """Peak resident set size of this process (the CPU analogue of peak device memory)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


class ZeroMetrics(Callback):
    """Log training-health and performance metrics every ``log_every_n_steps`` optimizer steps.

    Keys: ``train/lr`` (first param group), ``train/grad_norm`` (global, before clipping, unscaled),
    ``train/loss_scale`` (16-mixed), ``train/skipped_steps`` (fp16 overflows and non-finite steps),
    ``perf/tokens_per_s`` (all data-parallel replicas together), ``perf/step_time_s``,
    ``perf/peak_memory_gib`` (CUDA max allocated) or ``perf/peak_rss_gib`` (CPU), and on CUDA ``perf/tflops_per_device`` and ``perf/mfu``.
    Pipeline runs (``strategy.pipeline_bubble``): ``pipeline/bubble_theoretical`` ((P-1)/(M+P-1)),
    ``pipeline/bubble_measured`` (idle fraction of the average stage) and
    ``pipeline/bubble_measured_stage`` (the logging rank's stage, i.e. the first). Optimizers with
    ``comm_stats`` (1-bit Adam/LAMB): their statistics, e.g. ``onebit/bytes_sent`` (compressed) beside
    ``onebit/bytes_16bit_allreduce`` (uncompressed) and ``onebit/phase`` (0 warm-up, 1 compressed).
    Stage 3: ``comm/<label>_bytes_per_step``, the bytes this rank's parameter gathers and gradient
    reductions sent (:func:`traffic_metrics`; ZeRO++'s quantized ones included).
    Values come from rank 0 (Lightning's loggers write only there). The loss is logged by the
    LightningModule.

    Args:
        log_every_n_steps: logging period in optimizer steps; None follows ``Trainer(log_every_n_steps=)``.
        flops_per_token: training FLOPs per token for TFLOP/s and MFU; None reads the LightningModule's
            ``flops_per_token`` attribute, and without either no TFLOP/s are logged.
        peak_flops: the device's peak FLOP/s for MFU; None looks the device name up in
            :data:`PEAK_BF16_FLOPS` (bf16 peaks, so 32-true runs show a low MFU by construction).
        tokens_per_batch: counts the tokens in one rank's batch; default :func:`count_tokens`.
            Tokens/s multiply it by the data-parallel degree (every replica sees a batch of the same
            shape; see [Note: tokens per second]).
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        flops_per_token: Optional[float] = None,
        peak_flops: Optional[float] = None,
        tokens_per_batch: Optional[Callable[[Any], int]] = None,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}.")
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.tokens_per_batch = tokens_per_batch or count_tokens
        self._device: Optional[torch.device] = None
        self._resolved_peak: Optional[float] = None
        self._window_start: Optional[float] = None
        self._window_step = 0
        self._window_tokens = 0
        self._pause_start: Optional[float] = None
        self._paused = 0.0
        self._fallback_grad_norm: Optional[float] = None
        self._window_traffic: dict[str, int] = {}

    # ------------------------------------------------------------------ events

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = pl_module.device
        self._window_start = None
        if self._device.type == "cuda":
            name = torch.cuda.get_device_name(self._device)
            self._resolved_peak = self.peak_flops or peak_bf16_flops(name)
            if self._resolved_peak is None:
                rank_zero_info(
                    f"ZeroMetrics: no known peak FLOP/s for {name!r}, so MFU is not logged "
                    "(pass ZeroMetrics(peak_flops=...) to enable it)."
                )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._window_start is None:
            self._restart_window(trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Strategies without a grad_norm of their own (ddp, single device) hold full, already averaged
        # gradients on every rank, so the local norm is the global one. Sharded peers (fsdp) are skipped.
        if hasattr(trainer.strategy, "grad_norm") or not trainer.is_global_zero:
            return
        if not isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy)):
            return
        if (trainer.global_step + 1) % self._every(trainer) != 0:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            self._fallback_grad_norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
            ))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._window_tokens += self.tokens_per_batch(batch)
        step = trainer.global_step
        if step == self._window_step or step % self._every(trainer) != 0:
            return  # mid-accumulation, or not a logging step
        metrics = self._training_metrics(trainer)
        metrics.update(self._performance_metrics(trainer, step))
        metrics.update(pipeline_metrics(trainer.strategy))
        metrics.update(communication_metrics(trainer.optimizers))
        metrics.update(traffic_metrics(stage3_traffic(trainer.strategy), self._window_traffic, step - self._window_step))
        # Label with the step the LightningModule's self.log uses for this batch (Lightning's own
        # LearningRateMonitor does the same), so the loss and these metrics line up in TensorBoard.
        log_step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=log_step)
        self._restart_window(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._window_start is not None:  # sanity checking runs before the first window
            self._pause_start = self._now()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += self._now() - self._pause_start
            self._pause_start = None

    # ------------------------------------------------------------------ helpers

    def _every(self, trainer: Trainer) -> int:
        return self.log_every_n_steps or max(1, trainer.log_every_n_steps)

    def _now(self) -> float:
        """Wall clock after the device has finished the queued work (see [Note: timing windows])."""
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _restart_window(self, trainer: Trainer) -> None:
        self._window_start = self._now()
        self._window_step = trainer.global_step
        self._window_tokens = 0
        self._paused = 0.0
        self._window_traffic = stage3_traffic(trainer.strategy)

    def _training_metrics(self, trainer: Trainer) -> dict[str, float]:
        out: dict[str, float] = {}
        groups = getattr(trainer.optimizers[0], "param_groups", None) if trainer.optimizers else None
        if groups:
            out["train/lr"] = float(groups[0]["lr"])
        strategy = trainer.strategy
        grad_norm = getattr(strategy, "grad_norm", None) if hasattr(strategy, "grad_norm") else self._fallback_grad_norm
        if grad_norm is not None:
            out["train/grad_norm"] = float(grad_norm)
        loss_scale = getattr(strategy, "loss_scale", None)
        if loss_scale is None:  # Lightning's own 16-mixed (torch GradScaler), for comparison runs
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            loss_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        if loss_scale is not None:
            out["train/loss_scale"] = float(loss_scale)
        skipped = getattr(strategy, "skipped_steps", None)
        if skipped is not None:
            out["train/skipped_steps"] = float(skipped)
        return out

    def _performance_metrics(self, trainer: Trainer, step: int) -> dict[str, float]:
        assert self._window_start is not None
        elapsed = self._now() - self._window_start - self._paused
        steps = step - self._window_step
        out: dict[str, float] = {}
        if elapsed <= 0 or steps <= 0:
            return out
        tokens_per_s = self._window_tokens * data_parallel_size(trainer) / elapsed
        out["perf/step_time_s"] = elapsed / steps
        out["perf/tokens_per_s"] = tokens_per_s
        if self._device is not None and self._device.type == "cuda":
            out["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self._device) / GIB
            flops_per_token = self.flops_per_token or getattr(trainer.lightning_module, "flops_per_token", None)
            if flops_per_token:
                achieved = achieved_flops(float(flops_per_token), tokens_per_s, trainer.world_size)
                out["perf/tflops_per_device"] = achieved / 1e12
                if self._resolved_peak:
                    out["perf/mfu"] = achieved / self._resolved_peak
        else:
            rss = peak_host_rss_bytes()
            if rss is not None:
                out["perf/peak_rss_gib"] = rss / GIB
        return {k: v for k, v in out.items() if math.isfinite(v)}


__all__ = [
    "ZeroMetrics", "PEAK_BF16_FLOPS", "peak_bf16_flops", "achieved_flops", "count_tokens", "peak_host_rss_bytes",
    "data_parallel_size", "pipeline_metrics", "communication_metrics", "stage3_traffic", "traffic_metrics",
]
