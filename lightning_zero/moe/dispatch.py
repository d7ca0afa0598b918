"""Dispatch tokens to their experts and combine the experts' outputs, locally or across an expert-parallel
group with all-to-all.

[Note: expert-parallel dispatch]
With an expert-parallel (EP) group of ``P`` ranks, each rank holds ``E / P`` consecutive experts (rank
``r`` holds global experts ``r * E/P ... (r + 1) * E/P - 1``) and routes its own tokens. One call:

1. *Group*: the kept assignments of this rank's tokens are sorted by expert (stable, so within an expert
   they keep their slot order), which also sorts them by destination rank.
2. *Counts*: an equal-split all-to-all of the per-expert counts tells every rank how many rows it will
   receive from each peer for each of its local experts.
3. *Send*: one uneven ``all_to_all_single`` moves the token rows; a rank receives blocks ordered by
   source rank, then by local expert.
4. *Compute*: the rows are regrouped by local expert (a stable sort of their expert labels), each local
   expert runs once on all the rows it received, and the results are put back in arrival order.
5. *Return*: the reverse all-to-all sends each result back to the rank that owns the token, where it is
   scaled by its combine weight and summed into the token's output (two rows per token for top-2).

Why uneven splits rather than DeepSpeed's padded ``[E, capacity, hidden]`` exchange: no padding travels,
and without token dropping no rank has to agree on a common capacity first (DeepSpeed all-reduces the
maximum load over the EP group for that). The price is one small exchange of counts and a host read
of them (split sizes are Python ints).

Every local expert runs in every call, even on zero rows: its parameters then get a (zero) gradient
on every rank, so per-parameter gradient hooks of a ZeRO stage fire the same number of times
everywhere, instead of one rank waiting on a reduction that another rank never starts.

Autograd: the backward of an all-to-all is the all-to-all with the split lists swapped
(:class:`_AllToAll`), so gradients of the expert parameters are local to the rank that holds the expert
and the gradients of the tokens flow back to the ranks that own them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.moe.gating import Routing


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all of rows (see [Note: expert-parallel dispatch])."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                group: Optional[C.ProcessGroup]) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = list(out_splits), list(in_splits), group
        input = input.contiguous()
        output = input.new_empty((sum(ctx.out_splits),) + tuple(input.shape[1:]))
        C.all_to_all_single(output, input, ctx.out_splits, ctx.in_splits, group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        grad = grad.contiguous()
        grad_input = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        C.all_to_all_single(grad_input, grad, ctx.in_splits, ctx.out_splits, ctx.group)
        return grad_input, None, None, None


def all_to_all(input: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: Optional[C.ProcessGroup]) -> Tensor:
    """Send ``in_splits[j]`` rows of ``input`` to rank j, receive ``out_splits[i]`` rows from rank i;
    differentiable (the backward is the reverse exchange)."""
    return _AllToAll.apply(input, out_splits, in_splits, group)


def run_experts(rows: Tensor, counts: Sequence[int], experts: nn.ModuleList) -> Tensor:
    """``rows`` grouped by expert (``counts[j]`` rows for ``experts[j]``, in order) through their experts."""
    outputs = [expert(chunk) for expert, chunk in zip(experts, torch.split(rows, list(counts)))]
    return torch.cat(outputs, dim=0)


def dispatch_combine(
    x: Tensor,
    routing: Routing,
    experts: nn.ModuleList,
    group: Optional[C.ProcessGroup] = None,
) -> Tensor:
    """``[tokens, hidden]`` tokens through their routed experts, weighted and summed per token.

    ``experts`` are this rank's local experts; with a ``group`` of ``P`` ranks they are global experts
    ``rank * len(experts) ...`` and ``P * len(experts)`` must equal ``routing.num_experts``. Dropped
    assignments contribute nothing (a token dropped by every choice gets zeros, which the layer's
    caller typically adds to a residual)."""
    num_tokens, _ = x.shape
    top_k = routing.experts.shape[1]
    world = C.world_size(group) if group is not None else 1
    local = len(experts)
    if local * world != routing.num_experts:
        raise ValueError(f"{local} local experts x {world} expert-parallel ranks != {routing.num_experts} experts")

    # 1. Kept assignments, choice-major (first choices, then second), sorted by expert: slot order.
    kept = routing.kept.t().reshape(-1)
    expert_of = routing.experts.t().reshape(-1)[kept]
    token_of = torch.arange(num_tokens, device=x.device).repeat(top_k)[kept]
    weight_of = routing.weights.t().reshape(-1)[kept]
    order = torch.sort(expert_of, stable=True).indices
    expert_of, token_of, weight_of = expert_of[order], token_of[order], weight_of[order]
    counts = torch.bincount(expert_of, minlength=routing.num_experts)
    rows = x[token_of]

    if world == 1:
        out_rows = run_experts(rows, counts.tolist(), experts)
    else:
        out_rows = _expert_parallel(rows, counts, experts, world, group)

    weighted = out_rows * weight_of.to(out_rows.dtype).unsqueeze(1)
    return weighted.new_zeros((num_tokens,) + tuple(weighted.shape[1:])).index_add(0, token_of, weighted)


def _expert_parallel(rows: Tensor, counts: Tensor, experts: nn.ModuleList, world: int,
                     group: Optional[C.ProcessGroup]) -> Tensor:
    """Steps 2-5 of [Note: expert-parallel dispatch]: ``rows`` sorted by global expert, ``counts`` per
    global expert; returns the experts' outputs for ``rows``, in the same order."""
    local = len(experts)
    send_counts = counts.to(C.device_for(group, counts.device))
    recv_counts = torch.empty_like(send_counts)
    C.all_to_all(recv_counts, send_counts, group)  # recv_counts[i * local + j]: rows from rank i for expert j
    send_table = send_counts.view(world, local)
    recv_table = recv_counts.view(world, local)
    in_splits = send_table.sum(dim=1).tolist()
    out_splits = recv_table.sum(dim=1).tolist()

    received = all_to_all(rows, out_splits, in_splits, group)

    # Regroup by local expert: arrival order is (source rank, local expert); stable sort by expert.
    label = torch.arange(local).repeat(world).repeat_interleave(recv_table.reshape(-1).cpu())
    perm = torch.sort(label, stable=True).indices.to(received.device)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    outputs = run_experts(received[perm], recv_table.sum(dim=0).tolist(), experts)[inverse]

    return all_to_all(outputs, in_splits, out_splits, group)
