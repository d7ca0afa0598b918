"""Hydra entry point: train the example GPT with any registered strategy.

    python examples/train.py                                   # default job: gpt_small, zero2, 2 CPU procs / all GPUs
    python examples/train.py strategy=zero1 precision=bf16-mixed trainer.max_steps=200
    python examples/train.py strategy=ddp model=gpt_tiny trainer=debug logger=none
    python examples/train.py strategy=pipeline                 # the same GPTModule as 2 pipeline stages x zero1
    python examples/train.py model=gpt_moe strategy=zero2 strategy.expert_parallel=2   # MoE, experts split over 2 ranks
    python examples/train.py --cfg job                         # print the composed config and exit
    python examples/train.py ckpt_path=last                    # resume the newest run's last checkpoint, mid-epoch

Each run writes to ``runs/<date>/<time>/``: the config (``.hydra/``), TensorBoard events (``tb/``),
checkpoints, and ``train.log``, what the run did (run_log.py; other ranks' files hold their own messages).
An MoE run's checkpoints name experts by global index whatever ``expert_parallel`` wrote them (resume with
any); in one process, ``GPTModule.load_from_checkpoint(ckpt, expert_parallel=1)`` builds every expert.
Lightning starts the extra local processes by re-running this script with Hydra's run dir pinned, so
every rank composes the same config.
The GPT is built in ``GPTModule.configure_model`` (under zero3 on the meta device, each rank materialising
only its partition), after a check that this host has room for the model state (run_checks.py).
An unknown key (``+anything=1``, a misspelt ``seeed=1``) is refused before anything starts, in one line
(run_checks.py), and a refused run leaves no run directory behind. For sweeps over multi-process jobs, launch each job with
torchrun or SLURM rather than Hydra's ``-m`` (Lightning's re-launch and multirun do not mix well).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning.pytorch as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import MISSING, DictConfig, OmegaConf

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from data import DataConfig, TextDataModule
from gpt import GPT, GPTConfig, GPTModule, OptimConfig
from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.config.hydra import RunConfig, register_configs, trainer_kwargs
from lightning_zero.failures import reported_once
from lightning_zero.logging import ZeroMetrics
from lightning_zero.offload import estimator as est
from run_checks import ConfigRefused, check_host_room, check_keys, check_overrides, discard_if_empty, resolve_ckpt_path
from run_log import RunLog, log, quiet_lightning, share_file_handlers

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class TrainConfig(RunConfig):
    """Root schema of this example: the library's run config plus the GPT workload's parts."""

    model: GPTConfig = MISSING
    """Chosen by the ``model`` group (gpt_tiny, gpt_small, gpt_1b)."""
    data: DataConfig = MISSING
    """Chosen by the ``data`` group (pydoc)."""
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    """Chosen by the ``optimizer`` group (adamw, adam, sgd)."""


def build(cfg: DictConfig) -> tuple[L.Trainer, GPTModule, TextDataModule, Optional[str]]:
    """Trainer, model, data and the checkpoint to resume from, from a composed config; everything is
    validated before anything runs. The network itself is built later, in ``configure_model``, inside the
    strategy's context (ZeRO-3: on the meta device, then only this rank's partition is materialised)."""
    check_keys(cfg)
    try:
        run: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]  (runs the dataclasses' checks)
    except ValueError as err:  # a field's own check (ZeroConfig's, GPTConfig's, ...): its message is the line
        raise ConfigRefused(str(err).splitlines()[0]) from err
    ckpt_path = resolve_ckpt_path(run.ckpt_path, run.run_dir)
    strategy = instantiate(cfg.strategy, _convert_="all")
    check_optimizer_fits_strategy(run.optimizer.name, strategy)
    L.seed_everything(run.seed, workers=True)
    optim = asdict(run.optimizer)
    expert_parallel = strategy.config.expert_parallel if isinstance(strategy, ZeroStrategy) else 1
    model = GPTModule(
        model=run.model, max_steps=run.trainer.max_steps, optimizer=optim.pop("name"), pipeline=pipelined(strategy),
        expert_parallel=expert_parallel, deferred=True, **optim,
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
    callbacks += [instantiate(node, _convert_="all") for node in cfg.callbacks.values()]
    trainer_args = trainer_kwargs(OmegaConf.to_container(cfg.trainer, resolve=True))  # type: ignore[arg-type]
    on_cpu = trainer_args.get("accelerator") == "cpu" or not torch.cuda.is_available()
    fp16_on_cpu = trainer_args.get("precision") == "16-mixed" and on_cpu  # left to Lightning, which makes it bf16
    if isinstance(strategy, ZeroStrategy) and not fp16_on_cpu:  # Lightning would announce AMP, which this is not
        trainer_args["plugins"] = [ZeroPrecision(trainer_args.pop("precision"))]
    trainer = L.Trainer(
        strategy=strategy,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=run.checkpoint.enabled,
        **trainer_args,
    )
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # once per host, before any other process starts
        check_room(trainer, run.model, strategy, run.trainer.precision)
    return trainer, model, data, ckpt_path


def check_room(trainer: L.Trainer, model: GPTConfig, strategy: object, precision: str) -> None:
    """Refuse, in one line, a model whose state cannot fit this host (the estimator's figures,
    lightning_zero/offload/estimator.py): on CPU every process's model state, on a GPU the offloaded part."""
    with torch.device("meta"):
        params, unit = est.count_params(GPT(model))
    procs, nodes = trainer.num_devices, trainer.num_nodes
    on_cpu = trainer.strategy.root_device.type == "cpu"
    if isinstance(strategy, ZeroStrategy):
        c = strategy.config
        setting = est.Setting(c.stage, c.offload_optimizer, c.offload_params)
        work = est.Workload(params, procs, nodes, largest_unit=unit, compute_bytes=4 if precision.startswith("32") else 2)
        e = est.estimate(setting, work)
        need = e.cpu_bytes + (e.gpu_bytes * procs if on_cpu else 0)
    else:
        need = 16 * params * procs if on_cpu else 0  # fp32 weights, gradients and Adam's two moments per process
    hint = "use strategy=zero3 (each rank holds 1/N), an offload strategy on a GPU, fewer processes or a smaller model."
    what = f"model={model.n_layer}x{model.d_model} ({params / 1e6:.0f}M parameters) on {procs} process(es)"
    check_host_room(need, what, hint)


def check_optimizer_fits_strategy(name: str, strategy: object) -> None:
    """A 1-bit optimizer under a ZeRO stage it cannot use is refused here, before any process starts
    (the strategy would refuse it too, but only once every rank has launched and built the model)."""
    if name not in ("onebit_adam", "onebit_lamb") or not isinstance(strategy, ZeroStrategy):
        return
    from lightning_zero.optim import OneBitAdam, OneBitLamb

    cls = OneBitAdam if name == "onebit_adam" else OneBitLamb
    stages = list(cls.supported_zero_stages)
    if strategy.config.stage not in stages:
        raise ConfigRefused(
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
    quiet_lightning()
    try:
        trainer, model, data, ckpt_path = build(cfg)
    except ConfigRefused as err:
        discard_if_empty(cfg.run_dir)
        sys.exit(f"train.py: {err}")
    except BaseException:
        discard_if_empty(cfg.run_dir)  # a refused config leaves no empty run directory
        raise
    _announce(cfg, "start" if ckpt_path is None else f"resume from {ckpt_path}")
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    _announce(cfg, f"fit finished in {time.perf_counter() - start:.1f} s")
    val_loss = trainer.callback_metrics.get("val/loss")
    return None if val_loss is None else float(val_loss)  # for sweepers that minimise it


register_configs(TrainConfig)

if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:], TrainConfig, CONF_DIR)  # before Hydra creates a run directory
    except ConfigRefused as err:
        sys.exit(f"train.py: {err}")
    main()
