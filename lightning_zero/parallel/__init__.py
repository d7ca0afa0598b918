"""Tensor parallelism with torch's own tools, composed with ZeRO over the data-parallel dim (issue #17).

``configure_model`` applies a plan to the strategy's mesh:
``parallelize_module(self.model, self.device_mesh["tp"], tp_plan_llama(self.model, self.device_mesh["tp"]))``
(or :func:`parallelize`, which also checks the plan's names). Under pipeline stages, apply a per-layer
plan to the stage's layers with :func:`stage_plan` (stage.py [Note: TP plans per pipeline stage]).
"""

from lightning_zero.parallel.plans import parallelize, tp_plan_gpt, tp_plan_llama
from lightning_zero.parallel.stage import stage_plan
from lightning_zero.parallel.validate import check_plan, check_tensor_parallel

__all__ = ["check_plan", "check_tensor_parallel", "parallelize", "stage_plan", "tp_plan_gpt", "tp_plan_llama"]
