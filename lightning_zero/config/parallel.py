"""The parallel dimensions besides data parallelism: pipeline, tensor and expert parallel degrees
(lightning_zero/parallel_dims.py builds the mesh from them), and the pipeline's schedule."""

from __future__ import annotations

from dataclasses import dataclass


VALID_SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass
class ParallelConfig:
    """Degrees of the pipeline, tensor and expert dimensions, and the pipeline schedule."""

    pipeline_stages: int = 1
    """Pipeline-parallel degree; world size = data-parallel degree x pipeline_stages x tensor_parallel."""

    tensor_parallel: int = 1
    """Tensor-parallel degree: each layer's weights are split over this many ranks (contiguous ranks, one
    host), by torch's own tools: ``configure_model`` calls ``parallelize_module(module,
    self.device_mesh["tp"], plan)`` (ready plans in :mod:`lightning_zero.parallel`). ZeRO then partitions
    each rank's TP shard over the data-parallel ranks; world size = data-parallel degree x
    pipeline_stages x tensor_parallel (lightning_zero/parallel_dims.py). Stages 0-3; with pipeline_stages
    (stages 0-1) each stage's layers are parallelized over the tp sub-mesh of its pp rank
    (lightning_zero/parallel/stage.py [Note: TP plans per pipeline stage]); with CPU and NVMe offload
    (stages 1-3), on each rank's local TP shard."""

    expert_parallel: int = 1
    """Mixture of Experts (issue #20): experts of every :class:`lightning_zero.moe.MoE` layer are split
    over groups of this many data-parallel ranks (contiguous ranks), tokens exchanged by all-to-all inside
    a group. Non-expert parameters stay data parallel over every rank; expert parameters are reduced and
    partitioned by the ZeRO stage over the ranks holding the same experts (data-parallel degree /
    expert_parallel of them). Must divide the world size and each MoE layer's ``num_experts``; the
    strategy hands its group to the layers at setup (lightning_zero/moe/parallel.py [Note: who tells a
    layer its group]). Stages 0-3; not yet with pipeline_stages, tensor_parallel, offload, 1-bit
    optimizers or checkpoints."""

    microbatches: int = 4
    """Pipeline only: each batch is cut into this many equal micro-batches that flow through the stages
    one after another. More shrink the idle bubble (P-1)/(M+P-1) but make each matmul smaller; the
    per-rank training batch size must be a multiple of it."""

    schedule: str = "1f1b"
    """Pipeline only: '1f1b' (one forward one backward: at most P - s micro-batches of activations live on
    stage s), 'gpipe' (all forwards, then all backwards: M live, same bubble) or 'interleaved'
    (Megatron's interleaved 1F1B over ``virtual_stages`` model chunks per rank: bubble (P-1)/(V M+P-1)
    when a backward costs about two forwards, for V times the messages; microbatches must be a
    multiple of pipeline_stages)."""

    virtual_stages: int = 2
    """Pipeline with schedule='interleaved' only: model chunks per rank (Megatron's virtual pipeline size);
    the layers are split into pipeline_stages x virtual_stages parts."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """What the degrees cannot be or be combined with among themselves (the ZeRO stage's part is
        checked by ZeroConfig, which sees both)."""
        if not (isinstance(self.pipeline_stages, int) and self.pipeline_stages >= 1):
            raise ValueError(f"pipeline_stages must be an integer >= 1, got {self.pipeline_stages!r}.")
        if not (isinstance(self.microbatches, int) and self.microbatches >= 1):
            raise ValueError(f"microbatches must be an integer >= 1, got {self.microbatches!r}.")
        if self.schedule not in VALID_SCHEDULES:
            raise ValueError(f"schedule must be one of {list(VALID_SCHEDULES)}, got {self.schedule!r}.")
        if not (isinstance(self.virtual_stages, int) and self.virtual_stages >= 1):
            raise ValueError(f"virtual_stages must be an integer >= 1, got {self.virtual_stages!r}.")
        if self.pipeline_stages > 1 and self.schedule == "interleaved" and self.microbatches % self.pipeline_stages:
            raise ValueError(
                f"schedule='interleaved' needs microbatches ({self.microbatches}) to be a multiple of pipeline_stages "
                f"({self.pipeline_stages})."
            )
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not (isinstance(tp, int) and tp >= 1):
            raise ValueError(f"tensor_parallel must be an integer >= 1, got {tp!r}.")
        ep = self.expert_parallel  # what expert parallelism is not built with yet fails here, saying so (issue #20)
        if isinstance(ep, bool) or not (isinstance(ep, int) and ep >= 1):
            raise ValueError(f"expert_parallel must be an integer >= 1, got {ep!r}.")
        if ep > 1:
            for name, value in (("pipeline_stages", self.pipeline_stages), ("tensor_parallel", tp)):
                if value > 1:
                    raise ValueError(f"expert_parallel={ep} with {name}={value} is not built yet.")
