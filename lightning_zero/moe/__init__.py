"""Mixture of Experts (issue #20), as DeepSpeed-MoE offers it, natively on torch.distributed.

What exists: the :class:`MoE` layer (``layer.py``) with top-1 / top-2 gating, capacity-based token
dropping or none, noisy gating and the load-balancing auxiliary loss (``gating.py``), and the
expert-parallel dispatch: tokens exchanged with uneven all-to-all over an ``ep_group`` that the caller
creates, each rank running its ``num_experts / ep_size`` local experts (``dispatch.py``), or, with
``MoE(dispatch="capacity")``, through fixed ``[E, capacity]`` buffers and no host read (``capacity.py``). A
LightningModule adds :func:`aux_loss` of itself to its loss; ``layer.last_stats`` has per-expert token
counts and the dropped fraction for logging.

Expert parallelism in the strategy: ``ZeroStrategy(expert_parallel=EP)`` creates the expert-parallel
and expert-data-parallel groups (parallel_dims.py [Note: expert-parallel groups]) and hands the group to
layers built with ``MoE(..., ep_size=EP)`` (parallel.py [Note: who tells a layer its group]); expert
parameters (marked ``lz_expert`` / ``lz_expert_index``, see layer.py [Note: expert parameters]) are
reduced and partitioned by ZeRO stages 0-3 over the ranks holding the same experts while the rest stays
data parallel over the world, with gradient norm and clipping across both (zero/shard_comm.py).
:class:`lightning_zero.logging.MoEMetrics` logs the aux loss, tokens per expert and dropped fraction.

Sharded checkpoints store experts by global expert index, so a run resumes at another EP size and
consolidates to the single-process model's state dict (checkpoint/experts.py [Note: experts in sharded
checkpoints]); the full checkpoint format is refused under EP > 1.

Still to come: EP with pipeline or tensor parallelism, offload, 1-bit optimizers; the full checkpoint
format under EP > 1.
"""

from lightning_zero.moe.gating import Routing, TopKGate, topk_gating
from lightning_zero.moe.layer import MoE, MoEStats, aux_loss, is_expert_parameter

__all__ = ["MoE", "aux_loss", "MoEStats", "Routing", "TopKGate", "topk_gating", "is_expert_parameter"]
