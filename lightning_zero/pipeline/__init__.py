"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) combined with ZeRO data parallelism.

Write the model as a :class:`PipelineModule` of :class:`LayerSpec` / :class:`TiedLayerSpec` and call
``self.pipe((inputs, labels))`` in the LightningModule's steps; then
``Trainer(strategy=ZeroStrategy(stage=1, pipeline_stages=2, microbatches=8))`` (or ``strategy="pipeline"``)
splits it into stages. Files: ``specs.py`` (layer specs), ``partition.py`` (split math),
``module.py`` (the module), ``schedule.py`` (schedules as data), ``runtime.py`` (executes them),
``microbatch.py`` (batch splitting, activation shapes), ``buffers.py`` (receive buffers reused across micro-batches),
``tied.py`` (tied layers), ``checkpoint.py`` (combined checkpoints), ``timing.py`` (bubble),
``integration.py`` (what the strategy calls).
"""

from lightning_zero.pipeline.module import PipelineModule
from lightning_zero.pipeline.schedule import SCHEDULES, theoretical_bubble
from lightning_zero.pipeline.specs import LayerSpec, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "SCHEDULES", "theoretical_bubble"]
