"""Typed configuration of ZeroStrategy: the one place where its defaults are written.

Each concern is a dataclass of its own that validates itself (``config/stage3.py``, ``offload.py``,
``step.py``, ``checkpoint.py``, ``activations.py``, ``compile.py``, ``parallel.py``, ``launch.py``,
``fp8.py``, ...), and :class:`ZeroConfig` is all of them at once: its flat fields are theirs (inherited,
not restated), so ``ZeroStrategy(stage=3, prefetch_units=2)``, the registered presets, Hydra's ``conf/strategy/*.yaml``
and ``strategy.<name>=`` overrides all name options as before, while the engines take only their own
typed piece (``config.piece(Stage3Config)``). Hydra's ``conf/strategy/*.yaml`` files, the registered
strategy names and the ``ZeroStrategy`` constructor all read their defaults from these classes;
nothing else restates them (DeepSpeed writes its defaults in three places, and they drift).

[Note: adding a concern]
A coming feature (sequence parallel, low precision, inference) adds its options as a new dataclass in
``config/`` with its own ``validate``, lists it in :data:`SECTIONS` and among ZeroConfig's bases, and
hands ``config.piece(ThatConfig)`` to the code that reads it. What it cannot combine with in another
concern is checked in :meth:`ZeroConfig.validate` (the only place that sees every concern). Option
names are flat and unique across concerns, so every user-facing spelling (keyword, preset, Hydra
override) keeps working; ``tests/unit/test_config_structure.py`` checks that no default is written twice.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from lightning_zero.config.activations import ActivationConfig
from lightning_zero.config.checkpoint import CheckpointConfig
from lightning_zero.config.compile import COMPILE_ARGS, CompileConfig
from lightning_zero.config.fp8 import Fp8Config
from lightning_zero.config.inference import InferenceConfig
from lightning_zero.config.launch import LaunchConfig
from lightning_zero.config.mixed import MixedPrecisionConfig
from lightning_zero.config.offload import VALID_OFFLOAD, OffloadConfig
from lightning_zero.config.parallel import VALID_SCHEDULES, ParallelConfig
from lightning_zero.config.quantization import QuantCommConfig
from lightning_zero.config.sequence import SequenceConfig
from lightning_zero.config.stage3 import Stage3Config
from lightning_zero.config.state_precision import StatePrecisionConfig
from lightning_zero.config.step import VALID_NONFINITE, StepConfig

VALID_STAGES = (0, 1, 2, 3)

T = TypeVar("T")


@dataclass
class StageConfig:
    """Which ZeRO stage, and the size of the gradient communication buckets every stage uses."""

    stage: int = 2
    """ZeRO stage: 0 data parallel, 1 partitioned optimizer states, 2 also gradients, 3 also parameters."""

    bucket_size_mb: float = 50.0
    """Size cap of one gradient communication bucket, in MiB of 16-bit (or fp32) gradients.
    Larger buckets mean fewer, more efficient collectives; smaller ones start overlapping earlier."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.stage not in VALID_STAGES:
            raise ValueError(f"ZeRO stage must be one of {list(VALID_STAGES)}, got {self.stage!r}.")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb!r}.")


SECTIONS: tuple[type, ...] = (
    StageConfig, Stage3Config, ActivationConfig, ParallelConfig, OffloadConfig, CompileConfig, LaunchConfig,
    CheckpointConfig, StepConfig, SequenceConfig, QuantCommConfig, InferenceConfig, StatePrecisionConfig, Fp8Config,
    MixedPrecisionConfig,
)
"""ZeroConfig's concerns, in the order their validation runs (the order of the checks before the split, so
the first error reported for a config with several is, but for rare mixes, the same)."""

RETIRED = {"overlap_comm": (True, "gradient collectives are always launched asynchronously, overlapping backward")}
"""Options that were accepted and read by nothing, with the one value that describes what the code does
and why: that value is accepted with a warning, any other is refused (never silently ignored); None means
not given (the Hydra schema, config/hydra.py ``ZeroStrategyConf``, keeps the names as ``None`` fields, so
``strategy.overlap_comm=...`` overrides still compose)."""


@dataclass
class ZeroConfig(MixedPrecisionConfig, Fp8Config, StatePrecisionConfig, InferenceConfig, QuantCommConfig, SequenceConfig,
                 LaunchConfig, ParallelConfig, CompileConfig, ActivationConfig, CheckpointConfig, StepConfig,
                 OffloadConfig, Stage3Config, StageConfig):
    """What a ZeRO strategy does; every field has a sensible default.

    The fields are those of the concern dataclasses it derives from (bases are listed last-first, so
    ``fields(ZeroConfig)`` runs stage, stage 3, offload, ... as the classes below are read); see the
    module docstring and [Note: adding a concern].
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject bad values before any process group exists, naming the valid choices: each concern
        validates itself as it is built, and what spans two concerns is checked here."""
        self._pieces: dict[type, Any] = {}
        for cls in SECTIONS:
            if cls is OffloadConfig:  # the stage's part of offload first, as offload's checks always ran
                self._validate_across()
            piece = cls(**{f.name: getattr(self, f.name) for f in fields(cls)})
            for f in fields(cls):  # values a piece normalised (offload_ratio from Hydra's string)
                setattr(self, f.name, getattr(piece, f.name))
            self._pieces[cls] = piece

    def piece(self, cls: type[T]) -> T:
        """This config's values of one concern, as that concern's own (validated) dataclass."""
        return self._pieces[cls]

    def _validate_across(self) -> None:
        """The ZeRO stage against the pipeline and offload, and expert parallelism against offload."""
        if self.pipeline_stages > 1 and self.stage >= 2:
            raise ValueError(
                f"ZeRO stage {self.stage} cannot be combined with pipeline_stages={self.pipeline_stages}: stage 2/3 "
                "reduce gradients in every backward, and a pipeline runs one backward per micro-batch. Use stage=0 or "
                "stage=1 (which partitions optimizer states within each stage's data-parallel group), as DeepSpeed does."
            )
        if self.sequence_parallel > 1:
            others = {"pipeline_stages": self.pipeline_stages, "tensor_parallel": self.tensor_parallel,
                      "expert_parallel": self.expert_parallel}
            for name, value in others.items():
                if value > 1:
                    raise ValueError(f"sequence_parallel={self.sequence_parallel} with {name}={value} is not built yet.")
            if self.compile:
                raise ValueError(f"sequence_parallel={self.sequence_parallel} with compile is not built yet.")
        if self.compile and self.tensor_parallel > 1:  # dynamo failed on the DTensor parameters (tests/parallel)
            raise ValueError(f"compile with tensor_parallel={self.tensor_parallel} is not built yet.")
        self._validate_zeropp()
        self._validate_fp8()
        self._validate_autocast()
        if self.expert_parallel > 1 and self.offloads:
            raise ValueError(f"expert_parallel={self.expert_parallel} with offload_optimizer/offload_params is not built yet.")
        OffloadConfig.validate_choices(self)
        if self.offload_params != "none" and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs stage=3 (only ZeRO stage 3 partitions the "
                f"parameters), got stage={self.stage}. Use stage=3, or offload_optimizer alone with stages 1-2."
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(
                f"offload_optimizer={self.offload_optimizer!r} needs stage >= 1 (the CPU steps this rank's "
                "partition; stage 0 has none). Use stage=1, 2 or 3."
            )
        if self.offload_optimizer != "none" and self.pipeline_stages > 1:
            raise ValueError("offload_optimizer with pipeline_stages > 1 is not supported yet.")
        if self.state_precision != "fp32" and (self.stage == 0 or self.offload_optimizer != "none"):
            raise ValueError(
                f"state_precision={self.state_precision!r} needs stage 1, 2 or 3 without offload_optimizer (got stage="
                f"{self.stage}, offload_optimizer={self.offload_optimizer!r}): it is the layout of the device "
                "partition; offloaded states take offload_state_precision."
            )

    def _refuse_parallelism(self, what: str, why: str = "") -> None:
        """``what`` is built for data parallelism alone: refuse tensor, pipeline, expert or sequence parallelism."""
        others = {"tensor_parallel": self.tensor_parallel, "pipeline_stages": self.pipeline_stages,
                  "expert_parallel": self.expert_parallel, "sequence_parallel": self.sequence_parallel}
        for name, value in others.items():
            if value > 1:
                raise ValueError(f"{what} with {name}={value} is not built yet{why}.")

    def _validate_zeropp(self) -> None:
        """ZeRO++ (config/quantization.py) is a stage-3 feature, built for data parallelism alone."""
        q = QuantCommConfig(**{f.name: getattr(self, f.name) for f in fields(QuantCommConfig)})  # normalised
        if not q.zeropp:
            return
        on = {name: getattr(q, name) for name in ("quantized_weights", "quantized_gradients", "hpz_partition_size")
              if getattr(q, name) not in (False, 1) or isinstance(getattr(q, name), str)}
        what = ", ".join(f"{k}={v!r}" for k, v in on.items())
        if self.stage != 3:
            raise ValueError(f"{what} needs stage=3: ZeRO++ quantizes stage 3's parameter gathers and gradient "
                             f"reduce-scatters (got stage={self.stage}).")
        self._refuse_parallelism(what)
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) != "none":
                raise ValueError(f"{what} with {name}={getattr(self, name)!r} is not built yet.")

    def _validate_fp8(self) -> None:
        """FP8 linears (config/fp8.py) are built for data parallelism under stages 0-3."""
        recipe = Fp8Config(**{f.name: getattr(self, f.name) for f in fields(Fp8Config)}).fp8  # normalised
        if recipe is None:
            return
        self._refuse_parallelism(f"fp8={recipe!r}")

    def _validate_autocast(self) -> None:
        """``mixed_precision='autocast'`` keeps fp32 weights (config/mixed.py): what computes from 16-bit weights
        cannot combine with it."""
        if self.mixed_precision != "autocast":
            return
        self._refuse_parallelism("mixed_precision='autocast'", " (tested with data parallelism under stages 0-3, "
                                 "offload and compile): use mixed_precision='cast'")
        lowp = {"fp8": Fp8Config(**{f.name: getattr(self, f.name) for f in fields(Fp8Config)}).fp8,
                "state_precision": None if self.state_precision == "fp32" else self.state_precision,
                "offload_state_precision":
                    None if self.offload_state_precision == "fp32" else self.offload_state_precision}
        for name, value in lowp.items():
            if value is not None:
                raise ValueError(f"{name}={value!r} computes from bf16 weights, and mixed_precision='autocast' keeps "
                                 "them fp32: use mixed_precision='cast' (the default) with it.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ZeroConfig":
        """Build from keyword arguments, failing on unknown names with the list of valid ones
        (DeepSpeed silently drops constructor arguments when a config dict is passed: never here)."""
        for name, (works, why) in RETIRED.items():
            if name in kwargs:
                value = kwargs.pop(name)
                if value is None:  # the Hydra schema's "not given"
                    continue
                if value != works:
                    raise ValueError(f"{name}={value!r} is not built: {why} ({name}={works!r}).")
                warnings.warn(f"{name}={works!r} is what lightning_zero always does ({why}); the option will be "
                              "removed: drop the argument.", FutureWarning, stacklevel=4)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown ZeroStrategy option(s) {unknown}; valid options are {sorted(names)}.")
        return cls(**kwargs)


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for ``16-mixed`` (fp16 has too little range for raw gradients)."""

    initial_scale_power: int = 16
    """The first scale is 2**initial_scale_power."""

    growth_interval: int = 1000
    """Double the scale after this many consecutive steps without overflow."""

    hysteresis: int = 2
    """Number of overflows tolerated before the scale is lowered (DeepSpeed's meaning)."""

    min_scale: float = 1.0
    """The scale never drops below this; an overflow at the minimum is still skipped."""

    def __post_init__(self) -> None:
        if self.growth_interval < 1 or self.hysteresis < 1 or self.min_scale <= 0:
            raise ValueError(
                "LossScaleConfig needs growth_interval >= 1, hysteresis >= 1 and min_scale > 0, "
                f"got {self.growth_interval}, {self.hysteresis}, {self.min_scale}."
            )



def config_field_names() -> list[str]:
    """Names accepted by ZeroStrategy(**kwargs) besides its Lightning arguments."""
    return [f.name for f in fields(ZeroConfig)]


__all__ = [
    "ZeroConfig", "LossScaleConfig", "VALID_STAGES", "SECTIONS", "config_field_names", "StageConfig",
    "Stage3Config", "OffloadConfig", "StepConfig", "CheckpointConfig", "ActivationConfig", "CompileConfig",
    "ParallelConfig", "LaunchConfig", "QuantCommConfig", "StatePrecisionConfig",
    "COMPILE_ARGS", "VALID_OFFLOAD", "VALID_SCHEDULES", "VALID_NONFINITE",
]
