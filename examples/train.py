"""Hydra entry point: train the example GPT with any registered strategy.

    python examples/train.py                                   # default job: gpt_small, zero2, 2 CPU procs / all GPUs
    python examples/train.py strategy=zero1 precision=bf16-mixed trainer.max_steps=200
    python examples/train.py strategy=ddp model=gpt_tiny trainer=debug logger=none
    python examples/train.py strategy=pipeline                 # the same GPTModule as 2 pipeline stages x zero1
    python examples/train.py model=gpt_moe strategy=zero2 strategy.expert_parallel=2   # MoE, experts split over 2 ranks
    python examples/train.py --cfg job                         # print the composed config and exit

Each run writes to ``runs/<date>/<time>/``: the config (``.hydra/``), TensorBoard events (``tb/``),
checkpoints, and ``train.log``, what the run did (run_log.py; other ranks' files hold their own messages).
An MoE run's checkpoints name experts by global index whatever ``expert_parallel`` wrote them (resume with
any); in one process, ``GPTModule.load_from_checkpoint(ckpt, expert_parallel=1)`` builds every expert.
Lightning starts the extra local processes by re-running this script with Hydra's run dir pinned, so
every rank composes the same config. For sweeps over multi-process jobs, launch each job with
torchrun or SLURM rather than Hydra's ``-m`` (Lightning's re-launch and multirun do not mix well).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import hydra
import lightning.pytorch as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import MISSING, DictConfig, OmegaConf

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from data import DataConfig, TextDataModule
from gpt import GPTConfig, GPTModule, OptimConfig
from lightning_zero import ZeroStrategy
from lightning_zero.config.hydra import RunConfig, register_configs, trainer_kwargs
from lightning_zero.failures import reported_once
from lightning_zero.logging import ZeroMetrics
from run_log import RunLog, log, share_file_handlers


@dataclass
class TrainConfig(RunConfig):
    """Root schema of this example: the library's run config plus the GPT workload's parts."""

    model: GPTConfig = MISSING
    """Chosen by the ``model`` group (gpt_tiny, gpt_small, gpt_1b)."""
    data: DataConfig = MISSING
    """Chosen by the ``data`` group (pydoc)."""
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    """Chosen by the ``optimizer`` group (adamw, adam, sgd)."""


def build(cfg: DictConfig) -> tuple[L.Trainer, GPTModule, TextDataModule]:
    """Trainer, model and data from a composed config; everything is validated before anything runs."""
    run: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]  (runs the dataclasses' checks)
    L.seed_everything(run.seed, workers=True)

    strategy = instantiate(cfg.strategy, _convert_="all")
    check_optimizer_fits_strategy(run.optimizer.name, strategy)
    optim = asdict(run.optimizer)
    expert_parallel = strategy.config.expert_parallel if isinstance(strategy, ZeroStrategy) else 1
    model = GPTModule(
        model=run.model, max_steps=run.trainer.max_steps, optimizer=optim.pop("name"), pipeline=pipelined(strategy),
        expert_parallel=expert_parallel, **optim,
    )
    data = TextDataModule(**asdict(run.data))

    logger = instantiate(cfg.logger, _convert_="all") if cfg.logger is not None else False
    callbacks: list[Callback] = [RunLog()]
    if run.metrics.enabled:
        metrics = run.metrics
        callbacks.append(ZeroMetrics(log_every_n_steps=metrics.log_every_n_steps, peak_flops=metrics.peak_flops))
    if run.checkpoint.enabled:
        callbacks.append(ModelCheckpoint(
            dirpath=run.checkpoint.dirpath,
            every_n_train_steps=run.checkpoint.every_n_train_steps,
            save_last=run.checkpoint.save_last,
        ))
    trainer = L.Trainer(
        strategy=strategy,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=run.checkpoint.enabled,
        **trainer_kwargs(OmegaConf.to_container(cfg.trainer, resolve=True)),  # type: ignore[arg-type]
    )
    return trainer, model, data


def check_optimizer_fits_strategy(name: str, strategy: object) -> None:
    """A 1-bit optimizer under a ZeRO stage it cannot use is refused here, before any process starts
    (the strategy would refuse it too, but only once every rank has launched and built the model)."""
    if name not in ("onebit_adam", "onebit_lamb") or not isinstance(strategy, ZeroStrategy):
        return
    from lightning_zero.optim import OneBitAdam, OneBitLamb

    cls = OneBitAdam if name == "onebit_adam" else OneBitLamb
    stages = list(cls.supported_zero_stages)
    if strategy.config.stage not in stages:
        raise ValueError(
            f"optimizer={name} averages momentum with compressed communication, which works with ZeRO stage(s) "
            f"{stages} only; strategy has stage {strategy.config.stage}. Use strategy=zero{stages[0]}, or another optimizer."
        )


def pipelined(strategy: object) -> bool:
    """Whether the strategy runs pipeline stages: only then is the GPT built as a PipelineModule
    (otherwise the plain module, which Lightning's summary can describe: its type, FLOPs, shapes)."""
    return isinstance(strategy, ZeroStrategy) and strategy.config.pipeline_stages > 1


@rank_zero_only
def _announce(cfg: DictConfig, message: str) -> None:
    choices: dict[str, Optional[str]] = dict(HydraConfig.get().runtime.choices)
    picked = " ".join(f"{k}={v}" for k, v in choices.items() if not k.startswith(("hydra", "schema")))
    log.info(f"{message}: {picked} | run dir {cfg.run_dir}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@reported_once()  # Hydra prints an error on every rank: one rank in full, the others one line (failures.py)
def main(cfg: DictConfig) -> Any:
    share_file_handlers()  # Lightning's messages into this rank's log file too (run_log.py says why)
    trainer, model, data = build(cfg)
    _announce(cfg, "start")
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    _announce(cfg, f"fit finished in {time.perf_counter() - start:.1f} s")
    val_loss = trainer.callback_metrics.get("val/loss")
    return None if val_loss is None else float(val_loss)  # for sweepers that minimise it


register_configs(TrainConfig)

if __name__ == "__main__":
    main()
