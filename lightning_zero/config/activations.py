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

    activation_offload_device_fraction: float = 0.0
    """With ``activation_offload``: the share of the checkpointed modules (the last ones in forward
    order, which backward reaches first) whose checkpoints stay in device memory, as plain
    non-reentrant checkpointing; the rest go to host memory. For sequences whose checkpoints fit
    neither memory alone (2M tokens at SP 4 on the Llama-3-8B shape: 128 GiB of checkpoints per rank,
    four ranks' worth past a 503 GiB host): 0 offloads every one, 1 none (policy.py [Note: the
    device share])."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        fraction = self.activation_offload_device_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"activation_offload_device_fraction must be a number in [0, 1], got {fraction!r}.")
        if fraction and not self.activation_offload:
            raise ValueError("activation_offload_device_fraction splits activation_offload's checkpoints between "
                             "the device and the host: set activation_offload=True as well, or leave it at 0.")
        if self.activation_offload_policy is not None and (
            isinstance(self.activation_offload_policy, str)
            or not all(isinstance(x, str) for x in self.activation_offload_policy)
        ):
            raise ValueError(
                "activation_offload_policy must be a list of class names or module-name patterns, "
                f"got {self.activation_offload_policy!r}."
            )
