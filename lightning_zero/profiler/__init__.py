"""Flops profiler: per-module parameters, FLOPs/MACs (counted from the ops that run), latency and
TFLOP/s of one training step; a Lightning callback (:class:`FlopsProfiler`) and
``python -m lightning_zero.profiler`` for a one-off report on a model class."""

from lightning_zero.profiler.callback import FlopsProfiler
from lightning_zero.profiler.flops import FLOP_REGISTRY, OpFlopCounter, op_flops
from lightning_zero.profiler.modules import ModuleProfiler, ModuleStats, ProfileResult
from lightning_zero.profiler.report import StepTotals, render

__all__ = [
    "FlopsProfiler", "ModuleProfiler", "ModuleStats", "ProfileResult", "StepTotals", "render", "OpFlopCounter",
    "op_flops", "FLOP_REGISTRY",
]
