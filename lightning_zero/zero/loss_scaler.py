"""Dynamic loss scaling for fp16 (``16-mixed``).

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero;
the step unscales. An overflow (inf/nan in the global gradient norm, which every rank computes
identically after the all-reduce) skips the step on every rank and, after ``hysteresis`` overflows,
halves the scale; ``growth_interval`` clean steps in a row double it. Semantics follow DeepSpeed's
``DynamicLossScaler`` (hysteresis counts overflows, and refills after a clean growth interval).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_zero.config import LossScaleConfig


@dataclass
class DynamicLossScaler:
    config: LossScaleConfig = field(default_factory=LossScaleConfig)
    scale: float = 0.0
    clean_steps: int = 0
    hysteresis_left: int = 0
    overflows: int = 0

    def __post_init__(self) -> None:
        if self.scale == 0.0:
            self.scale = float(2**self.config.initial_scale_power)
        if self.hysteresis_left == 0:
            self.hysteresis_left = self.config.hysteresis

    def update(self, overflow: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.config.min_scale)
                self.hysteresis_left = self.config.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps % self.config.growth_interval == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.config.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state.get("overflows", 0))
