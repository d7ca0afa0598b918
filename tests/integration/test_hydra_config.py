"""Hydra configuration: every group option composes; bad choices and bad types fail with clear
messages; strategy files agree with the registered presets; the CLI runs 2-process jobs end to end
(zero2 with its optimizer offloaded, and the same GPTModule as 2 pipeline stages)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
sys.path.insert(0, str(ROOT / "examples"))

import train  # noqa: E402  (registers the schemas in Hydra's ConfigStore)

from lightning_zero.config import ZeroConfig  # noqa: E402
from lightning_zero.config.hydra import trainer_kwargs  # noqa: E402
from tests.helpers.launch import user_env  # noqa: E402
from tests.helpers.side_by_side import SideBySide  # noqa: E402

GROUPS = ("strategy", "precision", "optimizer", "model", "data", "trainer", "logger")


@pytest.fixture()
def hydra_ctx() -> Iterator[None]:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        yield


def _compose(*overrides: str) -> DictConfig:
    return compose(config_name="config", overrides=["run_dir=/tmp/lz-test-run", *overrides])


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_job(hydra_ctx: None) -> None:
    cfg = _compose()
    assert cfg.strategy._target_ == "lightning_zero.ZeroStrategy" and cfg.strategy.stage == 2
    assert cfg.trainer.precision == "32-true" and cfg.trainer.devices == "auto"
    assert cfg.model.n_layer == 4 and cfg.model.vocab_size == 256
    assert cfg.data.seq_len == cfg.model.seq_len == 128  # interpolated, not restated
    assert cfg.logger._target_.endswith("TensorBoardLogger") and cfg.logger.save_dir == "/tmp/lz-test-run"
    run = OmegaConf.to_object(cfg)  # every dataclass check passes
    assert isinstance(run, train.TrainConfig)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(hydra_ctx: None, group: str) -> None:
    assert len(_options(group)) >= 2 or group == "data"
    for option in _options(group):
        if (group, option) == ("strategy", "zero3_offload_nvme"):  # no default nvme_path (issue #27): refused
            with pytest.raises(ValueError, match="needs nvme_path"):
                OmegaConf.to_object(_compose(f"{group}={option}"))
            cfg = _compose(f"{group}={option}", f"strategy.nvme_path={CONF}")
        else:
            cfg = _compose(f"{group}={option}")
        OmegaConf.to_container(cfg, resolve=True)
        OmegaConf.to_object(cfg)


def test_precision_group_sets_trainer_precision(hydra_ctx: None) -> None:
    for option in _options("precision"):
        assert _compose(f"precision={option}").trainer.precision == option


def test_optimizer_and_logger_none(hydra_ctx: None) -> None:
    assert _compose("optimizer=sgd").optimizer.name == "sgd"
    assert _compose("logger=none").logger is None


def test_unknown_choice_lists_the_valid_options(hydra_ctx: None) -> None:
    with pytest.raises(MissingConfigException) as err:
        _compose("strategy=zero9")
    message = str(err.value)
    assert "Available options in 'strategy'" in message
    for option in ("ddp", "fsdp", "zero0", "zero1", "zero2"):
        assert f"\t{option}\n" in message or message.rstrip().endswith(option)
    assert "\tzero\n" not in message  # the schemas are not offered as choices
    with pytest.raises(MissingConfigException, match="bf16-mixed"):
        _compose("precision=fp8")


@pytest.mark.parametrize(
    "override, key",
    [("trainer.max_steps=abc", "trainer.max_steps"), ("strategy.stage=two", "strategy.stage"),
     ("model.d_model=wide", "model.d_model"), ("optimizer.lr=fast", "optimizer.lr")],
)
def test_wrong_type_names_the_key(hydra_ctx: None, override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        _compose(override)
    text = f"{err.value}\n{err.value.__cause__}"
    assert "could not be converted" in text and key in text


def test_unknown_key_is_rejected(hydra_ctx: None) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        _compose("trainer.max_step=10")
    assert "max_step" in f"{err.value}\n{err.value.__cause__}" and "TrainerConf" in str(err.value.__cause__)


def test_invalid_stage_fails_before_training(hydra_ctx: None) -> None:
    cfg = _compose("strategy.stage=7")
    with pytest.raises(ValueError, match=r"stage must be one of \[0, 1, 2, 3\]"):
        OmegaConf.to_object(cfg)


@pytest.mark.parametrize("optimizer", ["onebit_adam", "onebit_lamb"])
def test_onebit_with_stage_2_fails_before_any_process_starts(hydra_ctx: None, optimizer: str) -> None:
    """Found while composing the job (train.build), before the Trainer launches the other ranks."""
    cfg = _compose(f"optimizer={optimizer}", "strategy=zero2")
    with pytest.raises(ValueError, match=rf"optimizer={optimizer} .* stage\(s\) \[0\] only; strategy has stage 2"):
        train.build(cfg)
    train.check_optimizer_fits_strategy(optimizer, instantiate(_compose("strategy=zero0").strategy, _convert_="all"))


def test_strategy_files_match_the_registered_presets(hydra_ctx: None) -> None:
    registry = pytest.importorskip("lightning_zero.registry")
    zero_files = [o for o in _options("strategy") if o.startswith("zero") or o == "pipeline"]
    assert sorted(registry.PRESETS) == zero_files
    names = [f.name for f in fields(ZeroConfig)]
    for name, preset in registry.PRESETS.items():
        composed = OmegaConf.to_container(_compose(f"strategy={name}").strategy)
        assert isinstance(composed, dict)
        if name == "zero3_offload_nvme":  # no default path (issue #27): compared with one given
            assert composed["nvme_path"] is None and "nvme_path" not in preset
            composed["nvme_path"] = preset["nvme_path"] = str(Path(__file__).parent)
        assert {k: composed[k] for k in names} == asdict(ZeroConfig(**preset))


def test_instantiate_strategies(hydra_ctx: None) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    lz = pytest.importorskip("lightning_zero")
    if not hasattr(lz, "ZeroStrategy"):
        pytest.skip("lightning_zero.ZeroStrategy not available yet")
    for stage in (0, 1, 2):
        strategy = instantiate(_compose(f"strategy=zero{stage}").strategy, _convert_="all")
        assert isinstance(strategy, lz.ZeroStrategy) and strategy.config.stage == stage
    tuned = instantiate(_compose("strategy.bucket_size_mb=8").strategy, _convert_="all")
    assert tuned.config.bucket_size_mb == 8
    guarded = instantiate(_compose("strategy=zero3", "strategy.nonfinite=error", "strategy.max_nonfinite_steps=3").strategy,
                          _convert_="all")
    assert (guarded.config.nonfinite, guarded.config.max_nonfinite_steps) == ("error", 3)
    assert tuned.config.nonfinite == "skip" and tuned.config.max_nonfinite_steps == 8  # ZeroConfig's defaults
    with pytest.raises(InstantiationException, match=r"nonfinite must be one of \['skip', 'error', 'ignore'\]"):
        instantiate(_compose("strategy.nonfinite=warn").strategy, _convert_="all")
    assert isinstance(instantiate(_compose("strategy=ddp").strategy, _convert_="all"), DDPStrategy)


def test_instantiate_fsdp_peer(hydra_ctx: None) -> None:
    """FSDP runs only on GPU, but its config (per-block wrap policy) must build anywhere."""
    from gpt import Block
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = instantiate(_compose("strategy=fsdp").strategy, _convert_="all")
    assert isinstance(strategy, FSDPStrategy)
    assert Block in strategy.kwargs["auto_wrap_policy"]._module_classes


def test_cpu_devices_default() -> None:
    base: dict[str, Any] = {"accelerator": "cpu", "devices": "auto", "cpu_devices": 2}
    assert trainer_kwargs(base) == {"accelerator": "cpu", "devices": 2}
    assert trainer_kwargs({**base, "devices": 3}) == {"accelerator": "cpu", "devices": 3}
    assert "cpu_devices" not in trainer_kwargs({**base, "accelerator": "gpu"})


def _run_train(tmp_path: Path, *overrides: str, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``examples/train.py`` as a user starts it, in a clean launcher environment: a Lightning run earlier
    in this pytest process leaves LOCAL_RANK, WORLD_SIZE, MASTER_PORT... in os.environ, and with
    LOCAL_RANK set Lightning would wait for a rank 1 that it believes someone else starts."""
    env = user_env(**(env or {}))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), *overrides, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


CLI_JOBS = {
    "two_process": (["strategy=zero2_offload", "model=gpt_tiny", "trainer=debug", "data.batch_size=4"],
                    {"PYTHONWARNINGS": "default"}),
    "pipeline": (["strategy=pipeline", "model=gpt_tiny", "trainer=debug", "data.batch_size=4"], {}),
}
"""The module's two CLI jobs: overrides and environment on top of :func:`tests.helpers.launch.user_env`."""


@pytest.fixture(scope="module")
def cli_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], tuple[str, Path]]]:
    """Both jobs started at once (tests/helpers/side_by_side.py [Note: side by side]); ``job(name)`` waits for
    one, asserts it succeeded and returns its output and run directory."""
    dirs = {name: tmp_path_factory.mktemp(f"cli_{name}") for name in CLI_JOBS}
    runs = {name: SideBySide({name: [sys.executable, str(ROOT / "examples" / "train.py"), *overrides,
                                     f"hydra.run.dir={dirs[name]}"]}, cwd=ROOT, env=user_env(**env), timeout=180)
            for name, (overrides, env) in CLI_JOBS.items()}

    def job(name: str) -> tuple[str, Path]:
        proc = runs[name].get(name)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr, dirs[name]

    try:
        yield job
    finally:
        for started in runs.values():
            started.close()


def _assert_clean_output(out: str) -> None:
    """Issue #14's papercuts in a job's console output: no LR scheduler order warning (torch sees the
    offloaded optimizer step) and no deprecation warning raised by lightning_zero or torch.distributed
    (collectives under their current names)."""
    assert "lr_scheduler.step()" not in out, out[-3000:]
    for line in out.splitlines():
        if "Warning" in line or "deprecated" in line:
            assert "lightning_zero" not in line and "torch/distributed" not in line, line


def test_cli_two_process_job(cli_jobs: Callable[[str], tuple[str, Path]]) -> None:
    """The real entry point: Lightning re-launches it for rank 1 with Hydra's run dir pinned. Also
    issue #14's papercuts: the run's log files say what it did (none is empty), the model summary
    names the plain GPT and measures its FLOPs, no scheduler-order or deprecation warnings.

    [Note: one job, zero2 with its optimizer offloaded] Each CLI job costs two fresh interpreters (Lightning
    plus Hydra imports) on CI's 2 cores, so the job that checks the entry point is also the offload job of
    issue #14 (every offload run warned that ``lr_scheduler.step()`` came before ``optimizer.step()``: the
    CPU step bypasses ``optimizer.step``). zero2 without offload, the default job's strategy, is what
    ``zero2_offload`` adds the host step to; its collectives' deprecation check on 2 processes is
    tests/distributed/test_collectives.py, the scheduler order of every stage with and without offload is
    tests/offload/test_scheduler_order.py (in process)."""
    out, tmp_path = cli_jobs("two_process")
    assert "Starting with 2 processes" in out
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    _assert_clean_output(out)
    # the summary: the plain module, with measured FLOPs
    assert re.search(r"\bmodel\b\W+GPT\b", out) and "PipelineModule" not in out, out[-3000:]
    total = re.search(r"Total (?:FLOPs|Flops)\W*([0-9.]+)", out, re.IGNORECASE) or re.search(
        r"([0-9.]+)\s*[KMGT]?\s+Total Flops", out)
    assert total and float(total.group(1)) > 0, out[-3000:]
    # log files: none empty; rank 0's tells the run, rank 1's is its own (it ran in the same run dir)
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert set(logs) == {"train.log", "train_ddp_process_1.log"} and all(logs.values()), logs
    main = logs["train.log"]
    for expected in ("start: ", "strategy=zero2_offload", "fit: GPT (", "Starting with 2 processes", "step 3: val/loss ",
                     "step 6: val/loss ", "trained 6 steps", "last.ckpt", "fit finished in "):
        assert expected in main, (expected, main)
    assert "GLOBAL_RANK: 1" in logs["train_ddp_process_1.log"] and "GLOBAL_RANK: 1" not in main


def test_cli_pipeline_job(cli_jobs: Callable[[str], tuple[str, Path]]) -> None:
    """The same GPTModule as 2 pipeline stages on 2 CPU processes (1F1B over 4 micro-batches of 1):
    trains, logs the bubble next to its formula, and saves a checkpoint that loads, un-pipelined, into
    either form of the model."""
    import torch
    from gpt import GPT, GPTModule
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_zero.pipeline import PipelineModule

    out, tmp_path = cli_jobs("pipeline")
    assert "Starting with 2 processes" in out and "fit finished" in out
    assert re.search(r"\bmodel\b\W+PipelineModule\b", out)  # pipelining is on: the pipeline form
    assert "GLOBAL_RANK: 1" in (tmp_path / "train_ddp_process_1.log").read_text()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "val/loss", "perf/tokens_per_s", "train/grad_norm"} <= scalars
    assert {"pipeline/bubble_theoretical", "pipeline/bubble_measured"} <= scalars
    theory = [e.value for e in events.Scalars("pipeline/bubble_theoretical")]
    assert theory and all(abs(v - 1 / 5) < 1e-6 for v in theory)  # (P-1)/(M+P-1), P=2, M=4
    assert all(0.0 <= e.value < 1.0 for e in events.Scalars("pipeline/bubble_measured"))
    # Both stages' layers are in the checkpoint under their un-pipelined names.
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    logits = []
    for pipeline in (True, False):
        module = GPTModule.load_from_checkpoint(ckpt, pipeline=pipeline).eval()
        assert isinstance(module.model, PipelineModule if pipeline else GPT)
        with torch.no_grad():
            logits.append(module(idx))
    torch.testing.assert_close(logits[0], logits[1])
