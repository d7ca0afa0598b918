"""The Mixture-of-Experts layer: a drop-in replacement for a feed-forward block.

``MoE(hidden, expert=lambda: MLP(hidden), num_experts=8, top_k=2)`` routes each token of an input
``[..., hidden]`` to its ``top_k`` experts (gating.py), runs them (dispatch.py, across an expert-parallel
group when one is given) and returns the gate-weighted sum, of the input's shape. The load-balancing
loss of the last forward, already scaled by ``aux_loss_coef``, is ``layer.aux_loss``; add
:func:`aux_loss` of the whole model to the training loss.

[Note: expert parameters]
The layer holds only its *local* experts, ``num_experts / ep_size`` of them, in ``self.experts``; local
expert ``j`` on expert-parallel rank ``r`` is global expert ``r * num_experts / ep_size + j``. Every
parameter of an expert carries ``lz_expert = True`` and ``lz_expert_index`` (the global index): expert
parameters differ from rank to rank of the EP group, so a ZeRO integration must reduce and partition
them over the ranks that hold the *same* experts (the data-parallel replicas of the EP group), not over
the world, and a checkpoint must store them by global index so it can be loaded at another EP size. The
gate is an ordinary, replicated parameter. :func:`is_expert_parameter` reads the mark.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.moe.capacity import capacity_dispatch_combine
from lightning_zero.moe.dispatch import dispatch_combine
from lightning_zero.moe.gating import TopKGate, validate_gate_args


DISPATCHES = ("sorted", "capacity")
"""Values of ``MoE(dispatch=...)``: dispatch.py's sorted, host-read split sizes; capacity.py's fixed buffers."""


@dataclass
class MoEStats:
    """What one forward of an :class:`MoE` layer routed, for logging (detached; on the input's device)."""

    expert_counts: Tensor
    """``[num_experts]`` int64: assignments each expert was asked to take by this rank's tokens, before capacity."""
    dropped_fraction: Tensor
    """0-d: assignments dropped by the capacity / (tokens x top_k)."""
    capacity: int
    """Assignments per expert allowed in this forward."""


class MoE(nn.Module):
    """Mixture of Experts with top-1 or top-2 gating, capacity-based token dropping and expert parallelism.

    Args:
        hidden_size: last dimension of the input and output.
        expert: a factory called once per local expert, returning a module ``[n, hidden] -> [n, hidden]``
            that treats tokens independently (an MLP). A module instead of a factory is deep-copied once
            per local expert, as DeepSpeed's ``MoE(expert=module)`` does (the copies start identical).
        num_experts: experts in total, over the expert-parallel group.
        top_k: 1 (Switch) or 2 (GShard) experts per token.
        capacity_factor: capacity in training, as a multiple of the balanced load (gating.py [Note: capacity]).
        eval_capacity_factor: the same in eval mode.
        min_capacity: lower bound of the capacity.
        drop_tokens: drop assignments beyond the capacity; False: every expert takes all its tokens.
        noisy_gate_policy: None, ``'RSample'`` or ``'Jitter'`` (gating.py [Note: noisy gating]).
        aux_loss_coef: scale of the load-balancing loss stored in ``aux_loss``.
        ep_group: the expert-parallel process group; ``num_experts`` must be divisible by its size. None:
            every expert is local, unless ``ep_size`` says otherwise.
        ep_size: DeepSpeed's argument: the expert-parallel degree, when the group does not exist yet (a
            model built in ``__init__``, before the process group). The layer then holds ``num_experts /
            ep_size`` experts and waits for :meth:`set_ep_group`, which ``ZeroStrategy(expert_parallel=
            ep_size)`` calls at setup (moe/parallel.py [Note: who tells a layer its group]). Default: the
            group's size, or 1.
        dispatch: ``'sorted'`` (default): kept assignments sorted by expert, experts compute only those rows,
            split sizes read on the host once per layer (dispatch.py [Note: one host read per layer]);
            ``'capacity'``: fixed ``[E, capacity]`` buffers, no host read, experts compute every slot
            (capacity.py [Note: fixed-capacity dispatch]: needs ``drop_tokens=True`` and, under expert
            parallelism, the same number of tokens per forward on every rank of the group).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: Union[Callable[[], nn.Module], nn.Module],
        num_experts: int = 1,
        top_k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        noisy_gate_policy: Optional[str] = None,
        aux_loss_coef: float = 0.01,
        ep_group: Optional[C.ProcessGroup] = None,
        ep_size: Optional[int] = None,
        dispatch: str = "sorted",
    ) -> None:
        super().__init__()
        validate_gate_args(hidden_size, num_experts, top_k, capacity_factor, eval_capacity_factor, min_capacity,
                           noisy_gate_policy)
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        if dispatch == "capacity" and not drop_tokens:
            raise ValueError("dispatch='capacity' needs drop_tokens=True: without dropping the capacity is the "
                             "largest expert load, known only after a host read; use dispatch='sorted'.")
        if isinstance(expert, nn.Module):  # DeepSpeed's form: copies of one module
            template = expert
            expert = lambda: copy.deepcopy(template)  # noqa: E731
        if not callable(expert):
            raise TypeError(f"expert must be a factory returning an nn.Module (e.g. a lambda), got {expert!r}")
        group_size = C.world_size(ep_group) if ep_group is not None else None
        if ep_size is not None and group_size is not None and ep_size != group_size:
            raise ValueError(f"ep_size={ep_size} but the ep_group has {group_size} ranks")
        ep_size = group_size or ep_size or 1
        if not (isinstance(ep_size, int) and ep_size >= 1):
            raise ValueError(f"ep_size must be an integer >= 1, got {ep_size!r}")
        if num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel group size "
                             f"({ep_size})")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.dispatch = dispatch
        self.ep_group = ep_group
        self.ep_size = ep_size
        self.ep_rank = C.rank(ep_group) if ep_group is not None else 0
        self.num_local_experts = num_experts // ep_size
        self.gate = TopKGate(hidden_size, num_experts, top_k, capacity_factor, eval_capacity_factor, min_capacity,
                             drop_tokens, noisy_gate_policy)
        self.experts = nn.ModuleList(self._make_expert(expert) for _ in range(self.num_local_experts))
        self._mark_experts()
        self.aux_loss: Optional[Tensor] = None
        """``aux_loss_coef`` x the load-balancing loss of the last forward (differentiable); None before."""
        self.last_stats: Optional[MoEStats] = None
        """Routing statistics of the last forward; None before."""

    @staticmethod
    def _make_expert(factory: Callable[[], nn.Module]) -> nn.Module:
        module = factory()
        if not isinstance(module, nn.Module):
            raise TypeError(f"the expert factory must return an nn.Module, got {type(module).__name__}")
        return module

    def _mark_experts(self) -> None:
        """[Note: expert parameters]: the mark and the global index of every expert parameter."""
        for j, module in enumerate(self.experts):
            for param in module.parameters():
                param.lz_expert = True  # type: ignore[attr-defined]
                param.lz_expert_index = self.global_expert_index(j)  # type: ignore[attr-defined]

    @property
    def ep_bound(self) -> bool:
        """Whether the layer can run: its expert-parallel group is known (or it needs none)."""
        return self.ep_size == 1 or self.ep_group is not None

    def set_ep_group(self, group: Optional[C.ProcessGroup]) -> None:
        """Bind the expert-parallel group of a layer built with ``ep_size`` (DeepSpeed's ``_set_ep_group``);
        the local experts become global experts ``rank * num_local_experts ...`` of that group."""
        size = C.world_size(group) if group is not None else 1
        if size != self.ep_size:
            raise ValueError(f"this MoE layer holds {self.num_local_experts} of {self.num_experts} experts (ep_size="
                             f"{self.ep_size}), but the expert-parallel group has {size} ranks")
        self.ep_group = group if size > 1 else None
        self.ep_rank = C.rank(group) if size > 1 else 0
        self._mark_experts()

    def global_expert_index(self, local_index: int) -> int:
        """The global index of local expert ``local_index`` (see [Note: expert parameters])."""
        return self.ep_rank * self.num_local_experts + local_index

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE expects inputs [..., {self.hidden_size}], got {tuple(x.shape)}")
        if not self.ep_bound:
            raise RuntimeError(
                f"This MoE layer was built with ep_size={self.ep_size} but has no expert-parallel group: train it "
                f"under ZeroStrategy(expert_parallel={self.ep_size}), which sets the group at setup, or pass "
                "ep_group= (e.g. trainer.strategy.expert_parallel_group in configure_model).")
        tokens = x.reshape(-1, self.hidden_size)
        routing = self.gate(tokens)
        combine = capacity_dispatch_combine if self.dispatch == "capacity" else dispatch_combine
        out = combine(tokens, routing, self.experts, self.ep_group)
        self.aux_loss = routing.aux_loss * self.aux_loss_coef
        self.last_stats = MoEStats(routing.expert_counts, routing.dropped_fraction.detach(), routing.capacity)
        return out.view(x.shape[:-1] + out.shape[-1:]).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, ep_size={self.ep_size}, "
                f"aux_loss_coef={self.aux_loss_coef}, dispatch={self.dispatch}")


def aux_loss(module: nn.Module) -> Tensor:
    """The sum of ``aux_loss`` over every :class:`MoE` layer of ``module`` that has run a forward; add it to
    the training loss (``loss = task_loss + lightning_zero.moe.aux_loss(self)``). A 0-d zero when there is
    none. Layers keep the value of their *last* forward: call this after the forward of the step."""
    losses = [m.aux_loss for m in module.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        param = next(module.parameters(), None)
        return torch.zeros((), device=param.device if param is not None else None)
    return torch.stack([loss.float() for loss in losses]).sum()


def is_expert_parameter(param: Tensor) -> bool:
    """Whether ``param`` belongs to an MoE expert (see [Note: expert parameters])."""
    return bool(getattr(param, "lz_expert", False))
