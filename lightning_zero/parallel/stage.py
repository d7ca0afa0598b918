"""Tensor parallelism inside pipeline stages: a plan for the layers this stage holds (issue #17 item 4).

[Note: TP plans per pipeline stage]
Under ``ZeroStrategy(pipeline_stages=P, tensor_parallel=T)`` each pipeline stage is an ordinary
tensor-parallel module over the ``tp`` sub-mesh of its pp rank (``self.device_mesh["tp"]``), as in
torchtitan, where each stage's model part is parallelized on its own. A :class:`PipelineModule` created
in the LightningModule's ``__init__`` holds only this stage's layers by the time ``configure_model``
runs (the strategy places it in ``setup_environment``), so the user's ``configure_model`` does what it
would under Lightning's ``ModelParallelStrategy``, on the stage::

    def configure_model(self):
        tp = self.device_mesh["tp"]
        if tp.size() > 1:
            parallelize(self.pipe, tp, stage_plan(self.pipe, {"attn.q_proj": ColwiseParallel(), ...}))

:func:`stage_plan` turns a per-layer plan (names inside one layer) into a plan for the stage's module
(``layers.<i>.<name>``), for every local layer holding those submodules. Rowwise layers end in a
replicated activation, so what crosses a stage boundary is a plain tensor, the same on every tp rank:
each tp rank sends it to the same tp rank of the next stage (the runtime's group is the mesh's ``pp``
dim of this rank's (dp, tp) coordinate), and the gradients coming back are replicated too (torch's
``ColwiseParallel`` all-reduces its input gradient over tp).
"""

from __future__ import annotations

from typing import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

LAYER_CONTAINERS = ("layers", "tied")
"""Children of a :class:`~lightning_zero.pipeline.PipelineModule` holding this stage's layers."""


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def stage_plan(pipe: nn.Module, layer_plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A plan for ``parallelize_module(pipe, tp_mesh, plan)``: ``layer_plan`` (module names inside one
    layer, e.g. ``{"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}``) applied to every layer
    of ``pipe`` (a PipelineModule, this stage's layers) that holds all of its names; layers holding none
    stay replicated (embeddings, norms, heads). A layer holding only some of them is an error (a typo in
    the plan would otherwise leave half a block replicated). See [Note: TP plans per pipeline stage]."""
    if not layer_plan:
        raise ValueError("stage_plan: the layer plan is empty.")
    plan: dict[str, ParallelStyle] = {}
    children = dict(pipe.named_children())  # an unplaced PipelineModule builds all its layers here
    for container in LAYER_CONTAINERS:
        holder = children.get(container)
        if holder is None:
            continue
        for key, layer in holder.named_children():
            present = [name for name in layer_plan if _has(layer, name)]
            if not present:
                continue
            if len(present) != len(layer_plan):
                missing = sorted(set(layer_plan) - set(present))
                raise ValueError(
                    f"stage_plan: layer {container}.{key} ({type(layer).__name__}) has {present} but not {missing}; "
                    "layer-plan names are module names inside one layer (layer.named_modules())."
                )
            for name, style in layer_plan.items():
                plan[f"{container}.{key}.{name}"] = style
    return plan


__all__ = ["stage_plan"]
