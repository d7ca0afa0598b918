"""Plain per-token references for lightning_zero.moe: the oracles of tests/moe.

Written the obvious way, one token and one expert at a time, sharing no code with the package. Values
are built from scalar torch ops so that autograd gives the reference gradients too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class RefRouting:
    combine: Tensor          # [S, E, C] float (differentiable)
    dispatch: Tensor         # [S, E, C] bool
    capacity: int
    aux_loss: Tensor         # 0-d
    expert_counts: list[int]  # demand per expert, before capacity
    dropped_fraction: float
    assignments: list[list[tuple[int, Tensor]]]  # per token: kept (expert, weight)


def ref_gating(logits: Tensor, top_k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True) -> RefRouting:
    """GShard / DeepSpeed gating without noise, token by token (capacity filled in token order, all first
    choices before the second ones; top-2 weights renormalised over the surviving choices)."""
    S, E = logits.shape
    probs = [torch.softmax(logits[s].float(), dim=0) for s in range(S)]
    choices: list[list[int]] = []
    for s in range(S):
        p = probs[s].tolist()
        first = max(range(E), key=lambda e: p[e])
        picks = [first]
        if top_k == 2:
            picks.append(max((e for e in range(E) if e != first), key=lambda e: p[e]))
        choices.append(picks)
    counts = [0] * E
    for picks in choices:
        for e in picks:
            counts[e] += 1
    if drop_tokens:
        capacity = max(min_capacity, math.ceil(top_k * S / E * capacity_factor))
    else:
        capacity = max(max(counts), 1)

    fill = [0] * E
    slot: dict[tuple[int, int], int] = {}
    dropped = 0
    for j in range(top_k):
        for s in range(S):
            e = choices[s][j]
            if fill[e] < capacity:
                slot[(s, j)] = fill[e]
                fill[e] += 1
            else:
                dropped += 1

    dispatch = torch.zeros(S, E, capacity, dtype=torch.bool)
    assignments: list[list[tuple[int, Tensor]]] = []
    rows = []
    for s in range(S):
        gates = [probs[s][choices[s][j]] if (s, j) in slot else probs[s].new_zeros(()) for j in range(top_k)]
        if top_k == 2:
            denom = torch.clamp(gates[0] + gates[1], min=torch.finfo(torch.float32).eps)
            gates = [g / denom for g in gates]
        row = [[probs[s].new_zeros(()) for _ in range(capacity)] for _ in range(E)]
        kept = []
        for j in range(top_k):
            if (s, j) in slot:
                e, c = choices[s][j], slot[(s, j)]
                row[e][c] = gates[j]
                dispatch[s, e, c] = True
                kept.append((e, gates[j]))
        assignments.append(kept)
        rows.append(torch.stack([torch.stack(r) for r in row]))
    combine = torch.stack(rows)

    me = [sum(probs[s][e] for s in range(S)) / S for e in range(E)]
    ce = [sum(1 for s in range(S) if choices[s][0] == e) / S for e in range(E)]
    aux = E * sum(me[e] * ce[e] for e in range(E))
    return RefRouting(combine, dispatch, capacity, aux, counts, dropped / (S * top_k), assignments)


def ref_moe(x: Tensor, gate_weight: Tensor, experts: nn.ModuleList, top_k: int, capacity_factor: float,
            min_capacity: int, drop_tokens: bool) -> tuple[Tensor, Tensor]:
    """Dense loop reference of the MoE layer: each token through its kept experts, weighted by the gate.
    Returns (output of x's shape, unscaled aux loss)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens.float() @ gate_weight.float().t()
    routing = ref_gating(logits, top_k, capacity_factor, min_capacity, drop_tokens)
    out = []
    for s in range(tokens.shape[0]):
        acc = torch.zeros_like(tokens[s])
        for e, w in routing.assignments[s]:
            acc = acc + w * experts[e](tokens[s:s + 1])[0]
        out.append(acc)
    return torch.stack(out).view(x.shape), routing.aux_loss


class MLP(nn.Module):
    """A small GPT-style expert."""

    def __init__(self, hidden: int, inner: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, inner)
        self.proj = nn.Linear(inner, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(x)))
