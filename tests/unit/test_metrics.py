"""ZeroMetrics: the expected keys reach the trainer's logger in a 1-process CPU run (1-bit communication
statistics included); tokens/s over data-parallel replicas; pipeline bubble keys; FLOPs helpers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import WindowDataset  # noqa: E402
from gpt import GPTConfig, GPTModule, flops_per_token  # noqa: E402

from lightning_zero.logging import ZeroMetrics, peak_bf16_flops  # noqa: E402
from lightning_zero.logging.metrics import (  # noqa: E402
    achieved_flops, communication_metrics, count_tokens, data_parallel_size, pipeline_metrics, stage3_traffic,
    traffic_metrics,
)

TINY = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, seq_len=16)


class MemoryLogger(Logger):
    """Keeps every log_metrics call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.records.append((step, dict(metrics)))

    def keys_at(self, step: int) -> set[str]:
        return {k for s, m in self.records if s == step for k in m}


def _loader(batch_size: int = 4) -> DataLoader:
    return DataLoader(WindowDataset(torch.randint(0, 256, (4000,)), seq_len=16, stride=16), batch_size=batch_size)


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Lightning writes LOCAL_RANK, WORLD_SIZE, MASTER_PORT... into os.environ; later tests must not see them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _fit(
    strategy: Any, plugins: Optional[list[Any]] = None, steps: int = 4, module: Optional[GPTModule] = None
) -> tuple[MemoryLogger, ZeroMetrics]:
    logger, metrics = MemoryLogger(), ZeroMetrics(log_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, plugins=plugins, max_steps=steps,
        logger=logger, callbacks=[metrics], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, log_every_n_steps=2, gradient_clip_val=1.0,
    )
    module = module or GPTModule(model=TINY, warmup_steps=1, max_steps=steps)
    trainer.fit(module, train_dataloaders=_loader())
    return logger, metrics


PERF_KEYS = {"perf/tokens_per_s", "perf/step_time_s", "perf/peak_rss_gib"}


def test_single_device_run_logs_lr_grad_norm_and_throughput() -> None:
    logger, _ = _fit("auto")
    metric_steps = sorted({s for s, m in logger.records if "perf/tokens_per_s" in m})
    assert len(metric_steps) == 2  # steps 2 and 4, labelled like the module's train/loss
    keys = logger.keys_at(metric_steps[-1])
    assert {"train/lr", "train/grad_norm", "train/loss"} | PERF_KEYS <= keys
    assert "perf/mfu" not in keys and "train/loss_scale" not in keys  # CPU fp32
    last = {k: v for s, m in logger.records if s == metric_steps[-1] for k, v in m.items()}
    assert last["perf/tokens_per_s"] > 0 and last["perf/step_time_s"] > 0 and last["train/grad_norm"] > 0


def test_zero_strategy_metrics_come_from_the_strategy() -> None:
    lz = pytest.importorskip("lightning_zero")
    if not hasattr(lz, "ZeroStrategy"):
        pytest.skip("lightning_zero.ZeroStrategy not available yet")
    # The plugin is passed explicitly: Trainer(accelerator="cpu", precision="16-mixed") silently means bf16.
    logger, _ = _fit(lz.ZeroStrategy(stage=2), plugins=[lz.ZeroPrecision("16-mixed")])
    step = max(s for s, m in logger.records if "perf/tokens_per_s" in m)
    keys = logger.keys_at(step)
    assert {"train/lr", "train/grad_norm", "train/loss_scale", "train/skipped_steps"} | PERF_KEYS <= keys
    assert not any(k.startswith(("pipeline/", "onebit/", "comm/")) for k in keys)  # no pipeline, no 1-bit


class OneBitGPT(GPTModule):
    """The example GPT with 1-bit Adam (its warm-up phase lasts 2 steps)."""

    def configure_optimizers(self) -> Any:
        from lightning_zero.optim import OneBitAdam

        return OneBitAdam(self.param_groups(), lr=self.optim.lr, freeze_step=2)


def test_one_bit_communication_stats_are_logged() -> None:
    lz = pytest.importorskip("lightning_zero")
    module = OneBitGPT(model=TINY, max_steps=4)
    logger, _ = _fit(lz.ZeroStrategy(stage=0), module=module)
    opt = module.trainer.optimizers[0]
    if not isinstance(getattr(opt, "comm_stats", None), dict):
        pytest.skip("this 1-bit optimizer exposes no comm_stats")
    expected = {k for k, v in opt.comm_stats.items() if isinstance(v, (int, float))}
    steps = sorted(s for s, m in logger.records if "perf/tokens_per_s" in m)
    for step in steps:
        assert expected <= logger.keys_at(step)
    phase = [m["onebit/phase"] for s, m in logger.records if "onebit/phase" in m]
    if phase:  # warm-up (exact) for freeze_step=2 steps, compressed afterwards
        assert phase[0] == 0.0 and phase[-1] == 1.0


class FakeOptimizer:
    def __init__(self, stats: Any) -> None:
        self.comm_stats = stats


def test_communication_metrics_keys() -> None:
    stats = {"onebit/bytes_sent": 10, "onebit/bytes_16bit_allreduce": 160.0, "onebit/phase": 1.0,
             "ratio": torch.tensor(16.0), "label": "compressed", "bad": float("inf")}
    got = communication_metrics([FakeOptimizer(stats), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                 FakeOptimizer({"onebit/bytes_sent": 3})])
    assert got == {"onebit/bytes_sent": 10.0, "onebit/bytes_16bit_allreduce": 160.0, "onebit/phase": 1.0,
                   "comm/ratio": 16.0, "onebit/bytes_sent_opt2": 3.0}
    assert communication_metrics([FakeOptimizer(None)]) == {}


def test_pipeline_bubble_keys() -> None:
    strategy = SimpleNamespace(pipeline_bubble={"theoretical": 0.2, "measured": 0.25, "measured_stage": None})
    assert pipeline_metrics(strategy) == {"pipeline/bubble_theoretical": 0.2, "pipeline/bubble_measured": 0.25}
    full = SimpleNamespace(pipeline_bubble={"theoretical": 0.2, "measured": 0.25, "measured_stage": 0.3})
    assert set(pipeline_metrics(full)) == {
        "pipeline/bubble_theoretical", "pipeline/bubble_measured", "pipeline/bubble_measured_stage"
    }
    assert pipeline_metrics(SimpleNamespace(pipeline_bubble=None)) == {}  # a ZeroStrategy without stages
    assert pipeline_metrics(SimpleNamespace()) == {}  # ddp, fsdp, ...


def test_tokens_per_s_count_data_parallel_replicas_once() -> None:
    """Pipeline stages of one replica see the same batch: 2 stages x 1 replica is 1 batch per step."""
    pipelined = SimpleNamespace(strategy=SimpleNamespace(dims=SimpleNamespace(dp=1)), world_size=2)
    plain = SimpleNamespace(strategy=SimpleNamespace(), world_size=2)
    unset = SimpleNamespace(strategy=SimpleNamespace(dims=None), world_size=4)  # before setup_environment
    assert data_parallel_size(pipelined) == 1  # type: ignore[arg-type]
    assert data_parallel_size(plain) == 2  # type: ignore[arg-type]
    assert data_parallel_size(unset) == 4  # type: ignore[arg-type]
    rates = {}
    for name, trainer in (("pipelined", pipelined), ("plain", plain)):
        metrics = ZeroMetrics()
        metrics._now = lambda: 12.0  # type: ignore[method-assign]
        metrics._window_start, metrics._window_step, metrics._window_tokens = 10.0, 0, 1000
        rates[name] = metrics._performance_metrics(trainer, step=4)["perf/tokens_per_s"]  # type: ignore[arg-type]
    assert rates == {"pipelined": 500.0, "plain": 1000.0}


def test_validation_time_is_not_counted_as_step_time() -> None:
    metrics = ZeroMetrics()
    metrics._window_start = 0.0
    metrics.on_validation_start(None, None)  # type: ignore[arg-type]
    assert metrics._pause_start is not None
    metrics.on_validation_end(None, None)  # type: ignore[arg-type]
    assert metrics._pause_start is None and metrics._paused >= 0.0


def test_peak_table_prefers_specific_names() -> None:
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA L40") == 181e12
    assert peak_bf16_flops("NVIDIA GeForce GTX 1080") is None


def test_mfu_arithmetic_matches_the_design_reference() -> None:
    # DESIGN.md section 7: GPT-1.3B at 52.3k tokens/s on one H200 = 443 TFLOP/s.
    cfg = GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024)
    achieved = achieved_flops(flops_per_token(cfg), 52.3e3, world_size=1)
    assert achieved / 1e12 == pytest.approx(443, rel=0.01)
    assert achieved / peak_bf16_flops("NVIDIA H200") == pytest.approx(0.448, abs=0.005)  # type: ignore[operator]
    assert achieved_flops(1.0, 200.0, world_size=2) == 100.0


def test_count_tokens() -> None:
    x = torch.zeros(4, 16, dtype=torch.long)
    assert count_tokens((x, x)) == 64
    assert count_tokens({"input_ids": x, "labels": x}) == 64
    assert count_tokens(x) == 64
    with pytest.raises(TypeError, match="tokens_per_batch"):
        count_tokens(3)
    with pytest.raises(ValueError):
        ZeroMetrics(log_every_n_steps=0)


def test_stage3_traffic_is_logged_per_step() -> None:
    """Bytes the stage-3 engines counted (zero/zeropp.py), summed over engines, per step of a logging window."""
    from lightning_zero.comm.traffic import Traffic

    a, b = Traffic(), Traffic()
    a.add("param_gather", 100)
    b.add("param_gather", 20)
    b.add("grad_reduce", 30)
    strategy = SimpleNamespace(engines=[SimpleNamespace(bytes_sent=a.snapshot), SimpleNamespace(bytes_sent=b.snapshot),
                                        SimpleNamespace(bytes_sent=dict)])  # the last: an engine below stage 3
    now = stage3_traffic(strategy)
    assert now == {"param_gather": 120, "grad_reduce": 30}
    assert traffic_metrics(now, {"param_gather": 20}, 2) == {"comm/param_gather_bytes_per_step": 50.0,
                                                             "comm/grad_reduce_bytes_per_step": 15.0}
    assert stage3_traffic(SimpleNamespace()) == {} and traffic_metrics(now, {}, 0) == {}
