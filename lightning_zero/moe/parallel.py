"""Expert parallelism between the strategy and the MoE layers: binding the group, and expert state by
global index.

[Note: who tells a layer its group]
A DeepSpeed-MoE user builds ``MoE(..., ep_size=2)`` anywhere (``__init__`` included, before any process
group exists) and ``deepspeed.initialize`` creates the groups and hands each layer its group. Here the
same: ``ZeroStrategy(expert_parallel=2)`` creates the groups (parallel_dims.py [Note: expert-parallel
groups]) and, at setup, before the replicas are made identical and before the ZeRO engines partition
anything, :func:`bind_expert_parallel` checks every :class:`MoE` layer of the module and gives an
unbound one the strategy's group. A module built in ``configure_model`` may instead pass
``ep_group=self.trainer.strategy.expert_parallel_group``; the strategy then checks it is its own group.
Mismatches (a layer built for another EP size, a model with no MoE layer under ``expert_parallel`` > 1)
fail before the first step. Experts built by a layer with ``ep_size`` > 1 start as the factory makes
them on each rank (as in DeepSpeed); to start from a single-process model's experts, load its state
through :func:`localize_expert_state`.

[Note: expert state by global index]
A module's own ``state_dict`` names local experts ``...experts.<j>...``; with EP ranks holding
different experts those names collide across ranks. The global form names them by global expert index
(``j + ep_rank * num_local_experts``), which is what a single-process model of all experts has, so
the two functions below convert between a rank's local state and the global (EP 1) naming.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

from torch import nn

from lightning_zero.comm import collectives as C
from lightning_zero.moe.layer import MoE


def moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    """Every :class:`MoE` layer of ``module`` with its qualified name."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def _ranks(group: Optional[C.ProcessGroup]) -> list[int]:
    return [C.global_rank_of(group, i) for i in range(C.world_size(group))] if group is not None else []


def bind_expert_parallel(module: nn.Module, ep_size: int, ep_group: Optional[C.ProcessGroup]) -> list[MoE]:
    """Check every MoE layer against the strategy's ``expert_parallel`` and give unbound layers
    ``ep_group`` (see [Note: who tells a layer its group]); the layers."""
    layers = moe_layers(module)
    if ep_size > 1 and not layers:
        raise ValueError(
            f"expert_parallel={ep_size} but the model has no lightning_zero.moe.MoE layer: nothing to split. "
            "Use expert_parallel=1, or build the MoE layers (with ep_size=expert_parallel) before fit.")
    for name, layer in layers:
        if layer.ep_size != ep_size:
            raise ValueError(
                f"MoE layer '{name}' was built with ep_size={layer.ep_size} but the strategy has expert_parallel="
                f"{ep_size}: build it with MoE(..., ep_size={ep_size}) (the layer holds num_experts / ep_size "
                "experts per rank).")
        if layer.ep_size == 1:
            continue
        if layer.ep_group is None:
            layer.set_ep_group(ep_group)
        elif _ranks(layer.ep_group) != _ranks(ep_group):
            raise ValueError(
                f"MoE layer '{name}' has an ep_group of ranks {_ranks(layer.ep_group)}, but the strategy's expert-"
                f"parallel group of this rank is {_ranks(ep_group)}: pass ep_group=trainer.strategy."
                "expert_parallel_group, or leave ep_group out and let the strategy set it.")
    return [layer for _, layer in layers]


_EXPERT_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)experts\.(?P<index>\d+)\.(?P<rest>.+)$")


def _layer_prefixes(module: nn.Module) -> dict[str, MoE]:
    return {(name + "." if name else ""): layer for name, layer in moe_layers(module)}


def _renamed_experts(state: Mapping[str, Any], module: nn.Module, prefix: str,
                     index_of: Callable[[MoE, int], Optional[int]]) -> dict[str, Any]:
    """``state`` with each expert key's index replaced by ``index_of(layer, index)`` (dropped where it
    gives None); every key that is not an expert of one of ``module``'s MoE layers kept as it is."""
    layers = _layer_prefixes(module)
    out: dict[str, Any] = {}
    for key, value in state.items():
        m = _EXPERT_KEY.match(key[len(prefix):]) if key.startswith(prefix) else None
        layer = layers.get(m.group("prefix")) if m else None
        if layer is None:
            out[key] = value
            continue
        index = index_of(layer, int(m.group("index")))
        if index is not None:
            out[f"{prefix}{m.group('prefix')}experts.{index}.{m.group('rest')}"] = value
    return out


def localize_expert_state(state: Mapping[str, Any], module: nn.Module, prefix: str = "") -> dict[str, Any]:
    """A state dict in the global naming ([Note: expert state by global index]) -> ``module``'s own keys
    on this rank: the experts this rank holds, renamed to their local index; other experts dropped;
    every other entry kept. ``prefix``: what precedes ``module``'s names in ``state``."""

    def local(layer: MoE, index: int) -> Optional[int]:
        j = index - layer.ep_rank * layer.num_local_experts
        return j if 0 <= j < layer.num_local_experts else None

    return _renamed_experts(state, module, prefix, local)


def globalize_expert_state(state: Mapping[str, Any], module: nn.Module, prefix: str = "") -> dict[str, Any]:
    """``module``'s own state dict on this rank -> the global naming (local expert ``j`` renamed to its
    global index); merging every EP rank's result gives the single-process model's state dict."""
    return _renamed_experts(state, module, prefix, lambda layer, j: layer.global_expert_index(j))
