"""Typed Hydra schemas for training runs, registered in Hydra's ConfigStore.

Why typed: the YAML files under ``conf/`` are merged onto these dataclasses, so a misspelt key or a
value of the wrong type (``trainer.max_steps=abc``) fails at composition with the key's full path, and an
unknown group choice (``strategy=zero9``) fails with Hydra's list of the available options.

Why here and not in the YAML: defaults are written once. The ZeRO strategy schema is ZeroConfig
itself plus a ``_target_``; the peers' schemas (``ddp``, ``fsdp``) read their defaults from Lightning's
constructors; the trainer defaults below are the example job's and exist nowhere else. The YAML group
files only say what differs.

Application-specific parts (model, data, optimizer) are declared by the application: it subclasses
:class:`RunConfig` with typed fields and passes the class to :func:`register_configs`
(see ``examples/train.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lightning_zero.config.strategy import LossScaleConfig, ZeroConfig

ZERO_TARGET = "lightning_zero.ZeroStrategy"
DDP_TARGET = "lightning.pytorch.strategies.DDPStrategy"
FSDP_TARGET = "lightning.pytorch.strategies.FSDPStrategy"


@dataclass
class ZeroStrategyConf(ZeroConfig):
    """Schema of ``conf/strategy/zero*.yaml``: every ZeroConfig field with ZeroConfig's default,
    plus ZeroStrategy's ``loss_scale`` (used by 16-mixed only) and the retired names (``None``: not given)."""

    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling, e.g. ``strategy.loss_scale.initial_scale_power=12``."""
    overlap_comm: Optional[bool] = None
    """Retired (config/strategy.py ``RETIRED``): kept so that ``strategy.overlap_comm=true`` still composes."""
    _target_: str = ZERO_TARGET


def _peer_schema(name: str, target: str, ctor: Callable[..., Any], typed: Mapping[str, Any]) -> type:
    """A schema for a peer strategy whose defaults are read from the peer's own constructor.

    ``typed`` names the constructor arguments we expose and the OmegaConf-compatible type of each
    (the constructors' real annotations are unions OmegaConf cannot represent).
    """
    params = inspect.signature(ctor).parameters
    specs: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target))]
    for arg, typ in typed.items():
        default = params[arg].default
        specs.append((arg, typ, field(default=default)))
    return make_dataclass(name, specs)


def _ddp_schema() -> type:
    from lightning.pytorch.strategies import DDPStrategy

    return _peer_schema(
        "DDPStrategyConf", DDP_TARGET, DDPStrategy.__init__,
        {"process_group_backend": Optional[str], "start_method": str},
    )


def _fsdp_schema() -> type:
    from lightning.pytorch.strategies import FSDPStrategy

    return _peer_schema(
        "FSDPStrategyConf", FSDP_TARGET, FSDPStrategy.__init__,
        {
            "process_group_backend": Optional[str],
            "sharding_strategy": str,
            "state_dict_type": str,
            "cpu_offload": Optional[bool],
            "auto_wrap_policy": Any,
            "activation_checkpointing_policy": Any,
        },
    )


@dataclass
class TrainerConf:
    """The Lightning ``Trainer`` arguments a run may set; defaults are the example job's."""

    accelerator: str = "auto"
    """'auto', 'cpu', 'gpu'/'cuda', ..."""
    devices: Any = "auto"
    """Devices per node: 'auto' (all GPUs; ``cpu_devices`` processes on CPU), an int, or a list of ids."""
    cpu_devices: int = 2
    """Processes to start when devices='auto' runs on CPU (Lightning's 'auto' would start one, which
    exercises no ZeRO partitioning)."""
    num_nodes: int = 1
    """Number of machines (torchrun/SLURM start the processes there)."""
    precision: str = MISSING
    """Set by the ``precision`` group: '32-true', 'bf16-mixed' or '16-mixed'."""
    max_steps: int = 300
    """Optimizer steps to train; also the horizon of the cosine LR schedule."""
    max_epochs: Optional[int] = None
    """Epoch limit; None means max_steps decides."""
    val_check_interval: Optional[int] = 100
    """Validate every this many training batches (counted across epochs)."""
    check_val_every_n_epoch: Optional[int] = None
    """None lets val_check_interval count batches across epoch boundaries."""
    limit_val_batches: Optional[int] = None
    """Validation batches per check; None means the whole (small) validation split."""
    num_sanity_val_steps: int = 2
    """Validation batches run before training, to fail fast on validation bugs."""
    log_every_n_steps: int = 10
    """Logging period for the module's self.log and for ZeroMetrics."""
    gradient_clip_val: Optional[float] = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    enable_progress_bar: bool = True
    """Lightning's progress bar."""
    enable_model_summary: bool = True
    """Print the parameter table before training."""
    default_root_dir: str = "${run_dir}"
    """Where Lightning writes when nothing else says where."""


@dataclass
class TensorBoardConf:
    """Schema of ``conf/logger/tensorboard.yaml``: event files in ``<run_dir>/tb``."""

    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    save_dir: str = "${run_dir}"
    """Root of the event files; the run directory already makes each run unique."""
    name: str = "tb"
    """Sub-directory under save_dir."""
    version: Optional[str] = ""
    """'' writes straight into save_dir/name (no version_N directories: the run dir is the version)."""
    default_hp_metric: bool = False
    """Lightning's placeholder 'hp_metric' scalar is noise here."""


@dataclass
class CheckpointConf:
    """Lightning's ``ModelCheckpoint``: whether and where to save."""

    enabled: bool = True
    """Add a ModelCheckpoint callback (and let the Trainer checkpoint at all)."""
    dirpath: str = "${run_dir}/checkpoints"
    """Directory of the checkpoint files."""
    every_n_train_steps: Optional[int] = None
    """Save every this many optimizer steps; None saves at the end of each epoch and of training."""
    save_last: Any = "link"
    """'last.ckpt', the file to resume from: 'link' (a symlink to the newest checkpoint, no extra
    disk), true (a copy), or false/null (none)."""


@dataclass
class MetricsConf:
    """:class:`lightning_zero.logging.ZeroMetrics` settings."""

    enabled: bool = True
    """Log lr, grad norm, loss scale, tokens/s, step time, memory, TFLOP/s and MFU."""
    log_every_n_steps: Optional[int] = None
    """None follows trainer.log_every_n_steps."""
    peak_flops: Optional[float] = None
    """The device's peak FLOP/s for MFU; None looks it up by device name."""


@dataclass
class RunConfig:
    """Root schema of a training run; applications add their model/data/optimizer fields."""

    seed: int = 1234
    """Seed of every RNG on every rank (seed_everything with workers=True)."""
    run_dir: str = "${hydra:runtime.output_dir}"
    """This run's directory (Hydra's, kept the same on every rank by Lightning's launcher)."""
    strategy: Any = MISSING
    """Chosen by the ``strategy`` group; instantiated through its ``_target_``."""
    trainer: TrainerConf = field(default_factory=TrainerConf)
    logger: Any = None
    """Chosen by the ``logger`` group; None (``logger=none``) disables logging."""
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    metrics: MetricsConf = field(default_factory=MetricsConf)
    ckpt_path: Optional[str] = None
    """Resume from this checkpoint (a file, a sharded checkpoint directory, or a run directory, whose
    ``checkpoints/last.ckpt`` is taken), or ``last``: the newest ``checkpoints/last.ckpt`` of this run's
    directory or the run directories beside it (the chain of runs one resumes from the other). None
    trains from scratch."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Extra Lightning callbacks by name, each a node with a ``_target_``
    (``+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor``), as in lightning-hydra-template."""


def register_configs(root: type = RunConfig, store: Optional[ConfigStore] = None) -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent: storing again replaces).

    ``conf/config.yaml`` extends ``run_schema``; group files extend ``/schema/<group>/<name>@_here_``.
    The schemas live in a ``schema/`` tree of their own so that they do not show up as choices in the
    ``strategy``/``logger`` error listings.
    """
    cs = store or ConfigStore.instance()
    cs.store(name="run_schema", node=root)
    cs.store(group="schema/strategy", name="zero", node=ZeroStrategyConf)
    cs.store(group="schema/strategy", name="ddp", node=_ddp_schema())
    cs.store(group="schema/strategy", name="fsdp", node=_fsdp_schema())
    cs.store(group="schema/logger", name="tensorboard", node=TensorBoardConf)


def trainer_kwargs(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """``Trainer(**...)`` arguments from a resolved ``trainer`` node: turns ``cpu_devices`` into ``devices``."""
    kwargs = dict(trainer)
    cpu_devices = kwargs.pop("cpu_devices")
    accelerator = str(kwargs.get("accelerator", "auto"))
    on_cpu = accelerator == "cpu" or (
        accelerator == "auto" and not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )
    if kwargs.get("devices") == "auto" and on_cpu:
        kwargs["devices"] = cpu_devices
    return kwargs


__all__ = [
    "RunConfig", "TrainerConf", "ZeroStrategyConf", "TensorBoardConf", "CheckpointConf", "MetricsConf",
    "register_configs", "trainer_kwargs",
]
