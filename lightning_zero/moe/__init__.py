"""Mixture of Experts (issue #20), as DeepSpeed-MoE offers it, natively on torch.distributed.

What exists: the :class:`MoE` layer (``layer.py``) with top-1 / top-2 gating, capacity-based token
dropping or none, noisy gating and the load-balancing auxiliary loss (``gating.py``), and the
expert-parallel dispatch: tokens exchanged with uneven all-to-all over an ``ep_group`` that the caller
creates, each rank running its ``num_experts / ep_size`` local experts (``dispatch.py``). A
LightningModule adds :func:`aux_loss` of itself to its loss; ``layer.last_stats`` has per-expert token
counts and the dropped fraction for logging.

Still to come (the strategy integration): ``ZeroStrategy(expert_parallel=...)`` creating the EP groups;
expert parameters (marked ``lz_expert`` / ``lz_expert_index``, see layer.py [Note: expert parameters])
reduced and partitioned by ZeRO over the ranks holding the same experts while the rest stays data
parallel over the world, with gradient norm and clipping across both; checkpoints keyed by global expert
index (resume at another EP size); an MoE GPT example logging the statistics.
"""

from lightning_zero.moe.gating import Routing, TopKGate, topk_gating
from lightning_zero.moe.layer import MoE, MoEStats, aux_loss, is_expert_parameter

__all__ = ["MoE", "aux_loss", "MoEStats", "Routing", "TopKGate", "topk_gating", "is_expert_parameter"]
