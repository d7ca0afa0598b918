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
of them (split sizes are Python ints). The padded exchange exists too, as ``MoE(dispatch="capacity")``
(capacity.py [Note: fixed-capacity dispatch]): no host read, padding computed and sent.

[Note: one host read per layer]
Split sizes must be Python ints, so a layer reads its per-expert counts from the device once (across an
EP group, after the count exchange, together with the received counts: one read, not one before the
exchange and one after); every other index is computed on the device. Boolean-mask
indexing (``t[kept]``) is a host read too (its output size is data-dependent): selecting the kept
assignments that way cost three more per layer, 85 stream synchronisations per step of a 12-MoE-layer
GPT on one H100, each leaving the GPU idle while the host queued the next kernels. Dropped assignments
are sorted after the kept ones instead, and cut off with the count read anyway. ``index_select`` rather
than ``t[index]``: its backward is an ``index_add``, where advanced indexing's sorts its indices first.

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
    world = C.world_size(group) if group is not None else 1
    local = len(experts)
    if local * world != routing.num_experts:
        raise ValueError(f"{local} local experts x {world} expert-parallel ranks != {routing.num_experts} experts")

    # 1. Assignments choice-major (first choices, then second), stably sorted by expert with the dropped
    #    ones under a virtual expert E after the last: the kept ones come first, in slot order.
    #    [Note: one host read per layer]
    num_experts = routing.num_experts
    key = torch.where(routing.kept.t().reshape(-1), routing.experts.t().reshape(-1), num_experts)
    order = torch.sort(key, stable=True).indices
    # counted by index_add, not bincount: bincount reads the largest key on the host to size its output
    counts_all = torch.zeros(num_experts + 1, dtype=key.dtype, device=key.device).index_add_(0, key, torch.ones_like(key))
    if world == 1:
        counts = counts_all.tolist()[:num_experts]  # the host read: split sizes are Python ints
    else:
        counts, recv_counts, recv = _exchange_counts(counts_all[:num_experts], group)
    order = order[: sum(counts)]
    token_of = order % max(num_tokens, 1)  # choice-major: assignment i is token i mod tokens
    weight_of = routing.weights.t().reshape(-1).index_select(0, order)
    rows = x.index_select(0, token_of)

    if world == 1:
        out_rows = run_experts(rows, counts, experts)
    else:
        out_rows = _expert_parallel(rows, counts, recv_counts, recv, experts, world, group)

    weighted = out_rows * weight_of.to(out_rows.dtype).unsqueeze(1)
    return weighted.new_zeros((num_tokens,) + tuple(weighted.shape[1:])).index_add(0, token_of, weighted)


def _exchange_counts(counts: Tensor, group: Optional[C.ProcessGroup]) -> tuple[list[int], Tensor, list[int]]:
    """Step 2 of [Note: expert-parallel dispatch]: this rank's rows per global expert (``counts``, on the
    device) and, from the equal-split exchange, the rows it receives, ``[i * local + j]`` from rank ``i`` for
    its local expert ``j`` (on the device, and on the host). Both are read on the host together, after the
    exchange: one host read per layer under expert parallelism too, where a read before the exchange and
    another after it left the GPU idle twice ([Note: one host read per layer])."""
    send_counts = counts.to(C.device_for(group, counts.device))
    recv_counts = torch.empty_like(send_counts)
    C.all_to_all(recv_counts, send_counts, group)
    both = torch.cat([send_counts, recv_counts]).tolist()
    return both[: counts.numel()], recv_counts, both[counts.numel():]


def _expert_parallel(rows: Tensor, host_counts: list[int], recv_counts: Tensor, recv: list[int],
                     experts: nn.ModuleList, world: int, group: Optional[C.ProcessGroup]) -> Tensor:
    """Steps 3-5 of [Note: expert-parallel dispatch]: ``rows`` sorted by global expert, ``host_counts`` of
    them per global expert, ``recv_counts`` / ``recv`` the rows received per (source rank, local expert), on
    the device / host (:func:`_exchange_counts`); returns the experts' outputs for ``rows``, in the same order."""
    local = len(experts)
    in_splits = [sum(host_counts[r * local : (r + 1) * local]) for r in range(world)]
    out_splits = [sum(recv[r * local : (r + 1) * local]) for r in range(world)]

    received = all_to_all(rows, out_splits, in_splits, group)

    # Regroup by local expert: arrival order is (source rank, local expert); stable sort by expert,
    # computed on the device (a host-built index would be copied from pageable memory: a stream sync).
    device = received.device
    label = torch.arange(local, device=device).repeat(world).repeat_interleave(
        recv_counts.to(device), output_size=sum(out_splits))
    perm = torch.sort(label, stable=True).indices
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    per_expert = [sum(recv[r * local + j] for r in range(world)) for j in range(local)]
    outputs = run_experts(received.index_select(0, perm), per_expert, experts).index_select(0, inverse)

    return all_to_all(outputs, in_splits, out_splits, group)
