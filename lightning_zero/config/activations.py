"""ZeRO-R activation offload settings (lightning_zero/activations/policy.py [Note: the strategy option])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ActivationConfig:
    """Which modules are checkpointed with their inputs in host memory."""

    activation_offload: bool = False
    """ZeRO-R activation memory: checkpoint every stage-3 unit (below stage 3 and under pipeline stages:
    the repeated blocks units.py's default policy finds) with its checkpoint, the unit's input, kept in
    pinned host memory, copied out on a side stream and brought back ahead of the recomputation
    (lightning_zero/activations/policy.py [Note: the strategy option]). Saves one ``batch x seq x
    d_model`` tensor of device memory per unit for a full recomputation of each unit in backward and
    two PCIe copies. Leave the model's own activation checkpointing off when this is on."""

    activation_offload_policy: Optional[list[str]] = None
    """With ``activation_offload``: which modules are checkpointed, as class names or fnmatch patterns
    of module names (like ``unit_policy``); None takes the stage-3 units (or the repeated blocks)."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.activation_offload_policy is not None and (
            isinstance(self.activation_offload_policy, str)
            or not all(isinstance(x, str) for x in self.activation_offload_policy)
        ):
            raise ValueError(
                "activation_offload_policy must be a list of class names or module-name patterns, "
                f"got {self.activation_offload_policy!r}."
            )
