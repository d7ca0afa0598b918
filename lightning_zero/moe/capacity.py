"""Fixed-capacity dispatch and combine (``MoE(dispatch="capacity")``): the GShard / DeepSpeed layout of
``[E, capacity, hidden]`` expert buffers, filled and read by index, with no host read at all.

[Note: fixed-capacity dispatch]
With token dropping the capacity is known before any token is routed (gating.py [Note: capacity]) and
gating already gives every kept assignment its slot. So the flat position ``expert * capacity + slot``
of each assignment in an ``[E * capacity, hidden]`` buffer is computed on the device, the buffer is
one ``index_select`` of the tokens (the index built by one ``index_copy`` of token ids), each expert
runs on its ``capacity`` rows, and the combine is one ``index_select`` of the outputs times the combine
weight (summed over the two choices for top-2). Against the sorted dispatch (dispatch.py): no sort, no
count, no host read of split sizes; under expert parallelism every rank sends exactly
``capacity x E / P`` rows to each peer, so there is no count exchange and no second host read either.

The price is padding: every expert computes ``capacity`` rows whether or not they are filled, so at a
capacity factor of 1.25 the experts do up to 25% more FLOPs than the sorted dispatch's (which computes
only the kept rows), and the all-to-all moves as much more. Which costs more, the padding or the host
reads, depends on the machine and the model; the sorted dispatch stays the default.

Unfilled slots are filled with token 0's row rather than zeros (no padded copy of the tokens): no output
reads them, so their gradient is exactly zero and they add exact zeros to the expert's weight gradient
and to token 0's gradient; dropped assignments likewise read row 0 of the outputs with a combine weight
of exactly 0 (gating zeroes it). The outputs therefore equal the sorted dispatch's up to the order of
the experts' matmul reductions (different row counts).

Requirements, checked where they can be without a host read: ``drop_tokens=True`` (without dropping
the capacity is the largest load, known only on the host: refused at construction), and under expert
parallelism every rank of the group routes the same number of tokens per forward (equal micro-batch
shapes), since the capacity, and so the exchange size, follows from it. The exchange sizes are checked
by the all-to-all itself only as far as the backend does; a data loader giving ranks different shapes
must use the sorted dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.moe.dispatch import all_to_all
from lightning_zero.moe.gating import Routing


def capacity_dispatch_combine(
    x: Tensor,
    routing: Routing,
    experts: nn.ModuleList,
    group: Optional[C.ProcessGroup] = None,
) -> Tensor:
    """:func:`lightning_zero.moe.dispatch.dispatch_combine` through fixed ``[E, capacity]`` buffers
    (see [Note: fixed-capacity dispatch]); same arguments, same result up to matmul rounding."""
    num_tokens, hidden = x.shape
    world = C.world_size(group) if group is not None else 1
    local = len(experts)
    num_experts, capacity = routing.num_experts, routing.capacity
    if local * world != num_experts:
        raise ValueError(f"{local} local experts x {world} expert-parallel ranks != {num_experts} experts")
    if num_tokens == 0:  # an empty micro-batch still fills (zero) buffers and takes part in the exchange
        x = x.new_zeros(1, hidden) + x.sum()
    slots = num_experts * capacity

    # flat buffer position of each assignment; dropped ones go to a spare position past the buffer
    position = torch.where(routing.kept, routing.experts * capacity + routing.slots, slots)  # [tokens, k]
    token = torch.arange(position.shape[0], device=x.device).unsqueeze(1).expand_as(position)
    source = torch.zeros(slots + 1, dtype=torch.long, device=x.device)
    source.index_copy_(0, position.reshape(-1), token.reshape(-1))  # buffer row -> token (0 where unfilled)
    buffer = x.index_select(0, source[:slots])  # [E * capacity, hidden], grouped by expert

    if world == 1:
        out = _run(buffer.view(local, capacity, hidden), experts)
    else:
        rows = local * capacity  # to and from every peer: no count exchange, no host read
        received = all_to_all(buffer, [rows] * world, [rows] * world, group)  # [world, local, capacity, h]
        by_expert = received.view(world, local, capacity, hidden).transpose(0, 1).reshape(local, world * capacity,
                                                                                           hidden)
        outputs = _run(by_expert, experts)
        back = outputs.view(local, world, capacity, -1).transpose(0, 1).reshape(world * rows, -1)
        out = all_to_all(back, [rows] * world, [rows] * world, group)

    read = torch.where(routing.kept, position, 0)  # dropped: any row, times a weight of exactly 0
    gathered = out.index_select(0, read.t().reshape(-1)).view(routing.experts.shape[1], position.shape[0], out.shape[1])
    combined = gathered[0] * routing.weights[:, 0].to(gathered.dtype).unsqueeze(1)
    for choice in range(1, gathered.shape[0]):
        combined = combined + gathered[choice] * routing.weights[:, choice].to(gathered.dtype).unsqueeze(1)
    return combined


def _run(per_expert: Tensor, experts: nn.ModuleList) -> Tensor:
    """``[local, n, hidden]`` rows through their experts -> ``[local * n, out]``."""
    return torch.cat([expert(rows) for expert, rows in zip(experts, per_expert.unbind(0))], dim=0)
