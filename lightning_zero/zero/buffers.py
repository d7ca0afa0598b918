"""Module buffers kept equal across data-parallel ranks, as DDP's ``broadcast_buffers`` keeps them.

[Note: buffer sync]
Buffers are not parameters: ZeRO neither partitions nor reduces them. Most never change (masks,
rotary tables); some change in every training forward on each rank's own data (BatchNorm's running
statistics). DDP broadcasts rank 0's buffers before its forwards (when: below), so every rank evaluates
with rank 0's statistics; without the same, validation under ZeRO would differ from ``ddp`` rank by rank.
Before each step whose forward DDP would broadcast before, :class:`BufferSync` broadcasts from rank 0 the
buffers of every module one of whose buffers' version counter moved since the last sync. By module,
because BatchNorm's kernel rewrites ``running_mean``/``running_var`` without bumping their versions; only
its ``num_batches_tracked`` counter shows the change. Every rank runs the same program, so every rank
finds the same modules (the engines rely on that for the order of every collective; a module whose
buffers change on some ranks only, from the rank's own batch, breaks that: docs/testing-and-limits.md);
buffers that never change cost nothing, and nothing waits for the device.

When DDP broadcasts: before a forward that follows a training forward whose gradients were reduced
(``require_forward_param_sync``), so not before the forward after an accumulating micro-batch (``no_sync``),
after a validation batch, nor before the first training batch after validation; the buffers that change
there stay each rank's own, as under ddp. Visible where a training forward reads running statistics: QAT's
fused ``ConvBn`` scales its weight by ``running_var`` (a BatchNorm broadcast after every micro-batch put
accumulating runs 7e-4 apart from ddp in the losses, found 2026-11).

Quantization-aware training's observers move no version at all: ``prepare_qat``'s default fake quant
(``FusedMovingAvgObsFakeQuantize``) updates ``min_val``/``max_val``/``scale``/``zero_point`` inside one fused
kernel that bumps none of them, so their ranks kept their own statistics where ddp takes rank 0's (losses
2e-2 apart from ddp in 12 steps on a small conv net, found 2026-11). The modules of ``torch.ao.quantization``
(observers and fake quants, a few scalars or per-channel vectors each) are therefore broadcast at every sync
DDP would make, changed or not (tests/zoo "qat").

The ranks agree on which modules changed before broadcasting. Each rank sees only its own version counters, and a
buffer may change on some ranks only (a running maximum updated when this rank's batch exceeds it, a counter of
padded batches): deciding alone, the ranks issued different broadcasts, which hung at the collective timeout, or,
where the mismatched broadcasts had equal shapes and dtypes, paired the wrong buffers without an error (found
2026-11; ddp broadcasts every buffer, so it trained them). So the changed flags are max-reduced first over a gloo
twin of the group (comm/collectives.py ``host_twin``, made with the mesh: parallel_dims.py): a host-side
collective of one byte per module with buffers, no wait for the device, and every rank broadcasts the same
modules in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C


class BufferSync:
    """Broadcast the buffers of changed modules of ``module`` from data-parallel rank 0 (see the note)."""

    def __init__(self, module: nn.Module, group: Optional[C.ProcessGroup],
                 host_group: Optional[C.ProcessGroup] = None) -> None:
        self.groups: list[list[Tensor]] = []
        self.always: list[bool] = []
        """Per group: broadcast at every sync, whatever the versions say (observers, see the note)."""
        for m in module.modules():
            own = [b for b in m.buffers(recurse=False) if not b.is_meta]
            if own:
                self.groups.append(own)
                self.always.append(_unversioned(m))
        self.group = group
        self.host_group = host_group
        """A gloo group over ``group``'s ranks, where the changed flags are agreed (see the note). Every distributed
        run has one (parallel_dims.py builds it with the mesh); None only where ``group`` is gloo or one process."""
        self._versions = [[b._version for b in own] for own in self.groups]
        self._after_synced_forward = True
        """DDP's ``require_forward_param_sync``: the last forward was a training forward whose gradients were
        reduced (True before the first)."""

    def sync(self, reduces: bool = True) -> int:
        """Collective (every rank of ``group``) before a step's forward; ``reduces``: it is a training step whose
        gradients are reduced (not an accumulating micro-batch, not an evaluation). Returns how many buffers were
        broadcast."""
        if not self.groups or C.world_size(self.group) == 1:
            return 0
        due, self._after_synced_forward = self._after_synced_forward, reduces
        if not due:  # DDP would not broadcast before this forward (see the note)
            return 0
        changed = torch.tensor([int(self.always[i] or any(b._version != v for b, v in zip(own, self._versions[i])))
                                for i, own in enumerate(self.groups)], dtype=torch.uint8)
        C.all_reduce(changed, self.host_group if self.host_group is not None else self.group, op="max")
        sent = 0
        for i, own in enumerate(self.groups):
            if changed[i]:
                for b in own:
                    C.broadcast(b.data, 0, self.group)
                sent += len(own)
                self._versions[i] = [b._version for b in own]
        return sent


def _unversioned(m: nn.Module) -> bool:
    """A module whose forward may change its buffers without moving their versions ([Note: buffer sync])."""
    from torch.ao.quantization import FakeQuantizeBase, ObserverBase

    return isinstance(m, (FakeQuantizeBase, ObserverBase))
