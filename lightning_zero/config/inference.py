"""Inference (issue #31): how a run that only evaluates is set up (lightning_zero/inference/)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InferenceConfig:
    """Evaluation without ``fit`` (``predict`` / ``validate`` / ``test``)."""

    inference_partitions: bool = True
    """Stage 3, evaluating a module no ``fit`` has set up: partition the weights over the data-parallel
    ranks and gather them unit by unit (ZeRO-Inference; with ``offload_params`` streamed from host memory
    or NVMe; inference/engine.py). False: every rank materialises the whole model on its device and runs
    it without gathers, faster when it fits there (what every stage below 3 does)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.inference_partitions, bool):
            raise ValueError(f"inference_partitions must be True or False, got {self.inference_partitions!r}.")
