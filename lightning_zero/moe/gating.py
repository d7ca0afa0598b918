"""Top-1 and top-2 gating of a Mixture-of-Experts layer, as DeepSpeed-MoE (after GShard and Switch) does it.

The router is a bias-free linear map from the hidden size to ``E`` logits, computed in fp32. A softmax
gives each token a probability per expert; each token picks its ``k`` best experts; each expert accepts
at most ``capacity`` assignments, in token order, and drops the rest; the load-balancing auxiliary loss
pushes the router towards a uniform load. Everything is vectorised over tokens (one-hot masks and
cumulative sums, no per-token Python), so its cost does not depend on the batch beyond the tensor ops.

[Note: what gating returns]
:class:`Routing` holds the routing in *sparse* form, ``[tokens, k]`` tensors: the chosen expert, the slot
in that expert's capacity buffer, whether the assignment survived the capacity, and its combine weight.
GShard's dense tensors (``combine_weights`` and ``dispatch_mask`` of shape ``[tokens, E, capacity]``) are
derived from it on demand. Why not dense by default: without token dropping the capacity is the
largest expert load, up to all the tokens, and ``tokens x E x capacity`` floats for 8k tokens and 8
experts is over a gigabyte of which all but ``k`` entries per token are zero. The expert dispatch
(dispatch.py) needs only the sparse form; tests compare the dense form against a per-token reference.

[Note: capacity]
``capacity = max(min_capacity, ceil(k * tokens / E * capacity_factor))`` in training and the same with
``eval_capacity_factor`` in eval mode. The factor ``k``: top-2 makes two assignments per token, and
DeepSpeed's ``top2gating`` doubles the capacity factor for them (``_capacity(gates, capacity_factor * 2,
...)``), so a factor of 1.0 means "room for a perfectly balanced load" for both top-1 and top-2.
Assignments are placed in token order, all first choices before any second choice (a token's first
choice is never dropped to make room for another token's second choice). DeepSpeed's top-1 instead
picks the survivors by random priority ("random token selection"); token order is deterministic and
makes the dropped set a pure function of the logits, which is what the tests check against a per-token
reference. Without dropping, the capacity is the largest expert load of this call.

The auxiliary loss is GShard's / Switch's ``E * sum_e(me_e * ce_e)``: ``me_e`` the mean router
probability of expert ``e`` over the tokens, ``ce_e`` the fraction of tokens whose *first* choice is
``e``, counted before capacity (as DeepSpeed does for both top-1 and top-2). It is 1 for a perfectly
uniform router and load, and differentiable through ``me`` only.

[Note: noisy gating]
Noise is applied in training mode only; with ``noisy_gate_policy=None`` (or in eval mode) the gate is
deterministic. DeepSpeed's two policies:

* ``'Jitter'``: the router's *input* is multiplied by noise uniform in ``[1 - 1e-2, 1 + 1e-2]`` (Switch
  Transformer's multiplicative jitter); everything downstream sees the jittered logits.
* ``'RSample'``: Gumbel noise is added to the logits used to *choose* experts, while the gate weights,
  the capacity and the auxiliary loss use the clean probabilities. For top-1 it picks the expert; for
  top-2 it picks the second expert (the first stays the argmax), which is what DeepSpeed's
  ``top2_2nd_expert_sampling`` does, there by default; here only under this policy, so that a gate
  without a policy is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NOISY_GATE_POLICIES = (None, "RSample", "Jitter")
"""Values of ``noisy_gate_policy``, named as DeepSpeed names them (see [Note: noisy gating])."""
JITTER_EPS = 1e-2
"""Half-width of the multiplicative jitter of the router input (DeepSpeed's ``multiplicative_jitter``)."""


@dataclass
class Routing:
    """Where each token goes, in sparse form (see [Note: what gating returns]); ``k`` = 1 or 2."""

    experts: Tensor
    """``[tokens, k]`` int64: the chosen experts, first choice in column 0."""
    slots: Tensor
    """``[tokens, k]`` int64: the assignment's position in its expert's capacity buffer (meaningful where kept)."""
    kept: Tensor
    """``[tokens, k]`` bool: the assignment fits the capacity (False: the token is dropped by that expert)."""
    weights: Tensor
    """``[tokens, k]`` fp32: combine weight of each assignment, 0 where dropped; differentiable."""
    capacity: int
    """Assignments each expert accepts (see [Note: capacity])."""
    num_experts: int
    aux_loss: Tensor
    """Load-balancing loss, 0-d fp32, not yet scaled by a coefficient."""
    expert_counts: Tensor
    """``[E]`` int64: assignments each expert was asked to take, before capacity (the routing demand)."""
    dropped_fraction: Tensor
    """0-d fp32: dropped assignments / (tokens x k); for top-1, the fraction of tokens left unprocessed."""

    @property
    def combine_weights(self) -> Tensor:
        """GShard's dense ``[tokens, E, capacity]`` combine tensor (differentiable; memory-hungry)."""
        tokens, k = self.experts.shape
        dense = self.weights.new_zeros(tokens * self.num_experts * self.capacity)
        flat = (torch.arange(tokens, device=self.experts.device).unsqueeze(1) * self.num_experts
                + self.experts) * self.capacity + self.slots
        dense = dense.index_add(0, flat[self.kept], self.weights[self.kept])
        return dense.view(tokens, self.num_experts, self.capacity)

    @property
    def dispatch_mask(self) -> Tensor:
        """GShard's dense ``[tokens, E, capacity]`` bool dispatch tensor (True where a token takes a slot)."""
        tokens, _ = self.experts.shape
        mask = torch.zeros(tokens, self.num_experts, self.capacity, dtype=torch.bool, device=self.experts.device)
        rows = torch.arange(tokens, device=self.experts.device).unsqueeze(1).expand_as(self.experts)
        mask[rows[self.kept], self.experts[self.kept], self.slots[self.kept]] = True
        return mask


def compute_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int) -> int:
    """Assignments per expert when dropping tokens (see [Note: capacity])."""
    return max(int(min_capacity), math.ceil(top_k * num_tokens / num_experts * capacity_factor))


def gumbel_like(logits: Tensor) -> Tensor:
    """Standard Gumbel noise of ``logits``' shape (``-log`` of an Exp(1) sample, as torch's gumbel_softmax;
    clamped away from 0, which would make the noise infinite and the choice independent of the logits)."""
    return -torch.empty_like(logits).exponential_().clamp_min(torch.finfo(logits.dtype).tiny).log()


def topk_gating(
    logits: Tensor,
    top_k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    rsample: bool = False,
) -> Routing:
    """Route ``[tokens, E]`` router logits to the ``top_k`` (1 or 2) best experts.

    ``rsample`` adds Gumbel noise to the logits that choose the experts (see [Note: noisy gating]);
    the caller decides whether the policy applies (training mode only)."""
    if top_k not in (1, 2):
        raise ValueError(f"top_k must be 1 or 2, got {top_k}")
    tokens, num_experts = logits.shape
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    choose = logits + gumbel_like(logits) if rsample else logits

    # Top-2 keeps the clean argmax first and samples only the second (see [Note: noisy gating]).
    first = torch.argmax(choose if top_k == 1 else gates, dim=1)
    picks = [first]
    if top_k == 2:
        picks.append(torch.argmax(choose.scatter(1, first.unsqueeze(1), float("-inf")), dim=1))
    experts = torch.stack(picks, dim=1)  # [tokens, k]
    # [tokens, k, E]; scattered, not F.one_hot, which off CUDA reads the indices' min and max on the host
    mask = torch.zeros(tokens, top_k, num_experts, dtype=torch.long, device=logits.device).scatter_(
        2, experts.unsqueeze(2), 1)

    # Slots in token order, all first choices before the second ones (see [Note: capacity]).
    by_choice = mask.transpose(0, 1).reshape(top_k * tokens, num_experts)
    # the running count of each expert's assignments, scanned along a contiguous row per expert: a scan over
    # dim 0 of [tokens, E] runs E serial columns (1.3 ms per layer for 8192 tokens, E=4, on an H100); an
    # assignment's slot is its expert's count before it, gathered (not masked and summed over E)
    running = torch.cumsum(by_choice.t().contiguous(), dim=1)  # [E, k * tokens]
    slots_flat = running.gather(0, experts.t().reshape(1, -1)).squeeze(0) - 1
    slots = slots_flat.view(top_k, tokens).t()

    expert_counts = mask.sum(dim=(0, 1))
    if drop_tokens:
        capacity = compute_capacity(tokens, num_experts, top_k, capacity_factor, min_capacity)
    else:
        capacity = max(int(expert_counts.max()), 1)
    kept = slots < capacity

    chosen = torch.gather(gates, 1, experts) * kept
    if top_k == 2:
        denom = chosen.sum(dim=1, keepdim=True).clamp(min=torch.finfo(chosen.dtype).eps)
        chosen = chosen / denom

    # Sums over max(tokens, 1): a rank with an empty micro-batch still takes part in the expert-parallel
    # exchange, and gets a zero auxiliary loss and dropped fraction rather than NaNs.
    me = gates.sum(dim=0) / max(tokens, 1)
    ce = (expert_counts if top_k == 1 else mask[:, 0].sum(dim=0)).float() / max(tokens, 1)
    aux_loss = (me * ce).sum() * num_experts
    dropped = (~kept).sum().float() / max(kept.numel(), 1)
    return Routing(experts=experts, slots=slots, kept=kept, weights=chosen, capacity=capacity,
                   num_experts=num_experts, aux_loss=aux_loss, expert_counts=expert_counts.detach(),
                   dropped_fraction=dropped)


class TopKGate(nn.Module):
    """The router of an MoE layer: a bias-free fp32 linear map to ``E`` logits, then :func:`topk_gating`
    with the training or eval capacity factor and the noise policy of the mode (see [Note: noisy gating]).

    The weight is fp32 and the logits are computed in fp32 whatever the input dtype: routing decisions on
    bf16 logits flip between near-tied experts from one step to the next (DeepSpeed keeps its gate fp32
    for the same reason)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        noisy_gate_policy: Optional[str] = None,
    ) -> None:
        super().__init__()
        validate_gate_args(hidden_size, num_experts, top_k, capacity_factor, eval_capacity_factor, min_capacity,
                           noisy_gate_policy)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.reset_parameters()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.drop_tokens = drop_tokens
        self.noisy_gate_policy = noisy_gate_policy

    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation (also what ZeRO-3's sharded construction calls)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: Tensor) -> Routing:
        """Route ``[tokens, hidden]`` tokens."""
        x = x.float()
        noisy = self.noisy_gate_policy if self.training else None
        if noisy == "Jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        logits = F.linear(x, self.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return topk_gating(logits, self.top_k, factor, self.min_capacity, self.drop_tokens, rsample=noisy == "RSample")

    def extra_repr(self) -> str:
        return (f"hidden={self.weight.shape[1]}, experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}, "
                f"min_capacity={self.min_capacity}, drop_tokens={self.drop_tokens}, "
                f"noisy_gate_policy={self.noisy_gate_policy}")


def validate_gate_args(
    hidden_size: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    eval_capacity_factor: float,
    min_capacity: int,
    noisy_gate_policy: Optional[str],
) -> None:
    """Fail at construction, with the argument named, rather than with a shape error in the first step."""
    if top_k not in (1, 2):
        raise ValueError(f"top_k must be 1 or 2 (top-1 or top-2 gating), got {top_k!r}")
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be positive, got {hidden_size!r}")
    if num_experts < top_k:
        raise ValueError(f"num_experts ({num_experts!r}) must be at least top_k ({top_k})")
    for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if min_capacity < 0:
        raise ValueError(f"min_capacity must be >= 0, got {min_capacity!r}")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")
