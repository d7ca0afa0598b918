"""Typed configuration dataclasses: the single source of every default in lightning_zero.

:class:`ZeroConfig` is the flat view users write (keywords, presets, Hydra overrides); its concerns are
the dataclasses below, each validating itself, and each engine takes its own piece
(``config.piece(Stage3Config)``). See config/strategy.py [Note: adding a concern].
"""

from lightning_zero.config.activations import ActivationConfig
from lightning_zero.config.checkpoint import CheckpointConfig
from lightning_zero.config.compile import CompileConfig
from lightning_zero.config.decode import DecodeConfig
from lightning_zero.config.fp8 import Fp8Config
from lightning_zero.config.inference import InferenceConfig
from lightning_zero.config.launch import LaunchConfig
from lightning_zero.config.mixed import MixedPrecisionConfig
from lightning_zero.config.offload import OffloadConfig
from lightning_zero.config.parallel import ParallelConfig
from lightning_zero.config.quantization import QuantCommConfig
from lightning_zero.config.sequence import SequenceConfig
from lightning_zero.config.stage3 import Stage3Config
from lightning_zero.config.state_precision import StatePrecisionConfig
from lightning_zero.config.step import StepConfig
from lightning_zero.config.strategy import SECTIONS, VALID_STAGES, LossScaleConfig, StageConfig, ZeroConfig

__all__ = [
    "ZeroConfig", "LossScaleConfig", "VALID_STAGES", "SECTIONS", "StageConfig", "Stage3Config", "OffloadConfig",
    "StepConfig", "CheckpointConfig", "ActivationConfig", "CompileConfig", "ParallelConfig", "LaunchConfig", "SequenceConfig",
    "QuantCommConfig", "InferenceConfig", "StatePrecisionConfig", "Fp8Config", "MixedPrecisionConfig",
    "DecodeConfig",
]
