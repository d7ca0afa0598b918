"""The distributed environment both front doors set up the same way: world ranks, the default process
group, this job's groups (ParallelDims), and the collectives Lightning asks a strategy for.

The Trainer's strategy (strategy.py) and Fabric's (fabric/strategy.py) derive from different Lightning
base classes; each keeps Lightning's API (``root_device``, ``barrier``, ``reduce``, ...) as one-line
methods calling these functions, so neither inherits the other's plumbing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.config import ZeroConfig
from lightning_zero.parallel_dims import ParallelDims


def set_world_ranks(env: Optional[ClusterEnvironment], node_rank: int, local_rank: int, num_processes: int,
                    num_nodes: int) -> None:
    """This process's global rank and the world size, from the node and local ranks (Fabric's connector
    calls the strategies' ``_set_world_ranks`` before launch, so ``fabric.global_rank`` is right early)."""
    if env is None:
        return
    env.set_global_rank(node_rank * num_processes + local_rank)
    env.set_world_size(num_nodes * num_processes)
    # lightning declares no `rank` attribute on its rank_zero_only functions (it is set at run time):
    rank_zero_only.rank = utils_rank_zero_only.rank = env.global_rank()  # type: ignore[attr-defined]


def init_process_groups(config: ZeroConfig, env: Optional[ClusterEnvironment], world_size: int, global_rank: int,
                        device: torch.device) -> ParallelDims:
    """After the accelerator set its device up and the world ranks are known: the default process group
    and this job's groups (ParallelDims: data x pipeline x tensor x expert)."""
    reset_seed()
    dims = ParallelDims(world_size, global_rank, pp=config.pipeline_stages, tp=config.tensor_parallel,
                        ep=config.expert_parallel, sp=config.sequence_parallel, hpz=config.hpz_partition_size)
    backend = config.process_group_backend or _get_default_process_group_backend_for_device(device)
    if world_size > 1 or C.is_initialized():
        _init_dist_connection(env, backend, timeout=timedelta(seconds=config.timeout_s))
    dims.build_groups(config.timeout_s, device.type)
    return dims


def sampler_kwargs(dims: Optional[ParallelDims], num_replicas: int, rank: int) -> dict[str, Any]:
    """Data is sharded by data-parallel replica only: the stages of one pipeline, and the ranks of one
    sequence-parallel group, see the same batch."""
    if dims is not None:
        return {"num_replicas": dims.data_parallel, "rank": dims.data_rank}
    return {"num_replicas": num_replicas, "rank": rank}


def barrier(device: torch.device) -> None:
    C.barrier(None, device_ids=[device.index] if device.type == "cuda" else None)


def broadcast(obj: Any, src: int = 0) -> Any:
    return C.broadcast_object(obj, src, None)


def reduce(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
    """Lightning's ``reduce`` (Trainer) / ``all_reduce`` (Fabric): mean, sum, max or min over ``group``."""
    if not isinstance(tensor, Tensor) or C.world_size(group) == 1:
        return tensor
    op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    if op in ("avg", "mean"):
        out = tensor.detach().clone().float() if not tensor.is_floating_point() else tensor.detach().clone()
        C.all_reduce(out, group, "sum")
        return out / C.world_size(group)
    if op not in ("sum", "max", "min"):
        raise ValueError(f"reduce_op must be one of 'mean', 'sum', 'max', 'min'; got {reduce_op!r}")
    out = tensor.detach().clone()
    C.all_reduce(out, group, op)
    return out


def all_gather(tensor: Tensor, group: Optional[Any] = None) -> Tensor:
    t = tensor.contiguous()
    out = [torch.empty_like(t) for _ in range(C.world_size(group))]
    C.all_gather_list(out, t, group)
    return torch.stack(out)
