"""Module buffers kept equal across data-parallel ranks, as DDP's ``broadcast_buffers`` keeps them.

[Note: buffer sync]
Buffers are not parameters: ZeRO neither partitions nor reduces them. Most never change (masks,
rotary tables); some change in every training forward on each rank's own data (BatchNorm's running
statistics). DDP broadcasts rank 0's buffers before every forward, so every rank evaluates with rank
0's statistics; without the same, validation under ZeRO would differ from ``ddp`` rank by rank.
Before each step, :class:`BufferSync` broadcasts from rank 0 the buffers of every module one of
whose buffers' version counter moved since the last sync. By module, because BatchNorm's kernel
rewrites ``running_mean``/``running_var`` without bumping their versions; only its
``num_batches_tracked`` counter shows the change. Every rank runs the same program, so every rank
finds the same modules (the engines rely on that for the order of every collective); buffers that
never change cost nothing, and nothing waits for the device.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from lightning_zero.comm import collectives as C


class BufferSync:
    """Broadcast the buffers of changed modules of ``module`` from data-parallel rank 0 (see the note)."""

    def __init__(self, module: nn.Module, group: Optional[C.ProcessGroup]) -> None:
        self.groups: list[list[Tensor]] = []
        for m in module.modules():
            own = [b for b in m.buffers(recurse=False) if not b.is_meta]
            if own:
                self.groups.append(own)
        self.group = group
        self._versions = [[b._version for b in own] for own in self.groups]

    def sync(self) -> int:
        """Collective (every rank of ``group``); returns how many buffers were broadcast."""
        if not self.groups or C.world_size(self.group) == 1:
            return 0
        sent = 0
        for i, own in enumerate(self.groups):
            if any(b._version != v for b, v in zip(own, self._versions[i])):
                for b in own:
                    C.broadcast(b.data, 0, self.group)
                sent += len(own)
                self._versions[i] = [b._version for b in own]
        return sent
