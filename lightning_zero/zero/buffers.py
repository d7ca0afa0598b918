"""Module buffers kept equal across data-parallel ranks, as DDP's ``broadcast_buffers`` keeps them.

[Note: buffer sync]
Buffers are not parameters: ZeRO neither partitions nor reduces them. Most never change (masks,
rotary tables); some change in every training forward on each rank's own data (BatchNorm's running
statistics). DDP broadcasts rank 0's buffers before every forward, so every rank evaluates with rank
0's statistics; without the same, validation under ZeRO would differ from ``ddp`` rank by rank.
Before each step, :class:`BufferSync` broadcasts from rank 0 the buffers whose version counter moved
since the last sync. Every rank runs the same program, so every rank finds the same list (the
engines rely on that for the order of every collective); buffers that never change cost nothing,
and nothing waits for the device.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_zero.comm import collectives as C


class BufferSync:
    """Broadcast changed buffers of ``module`` from data-parallel rank 0 (see the note)."""

    def __init__(self, module: nn.Module, group: Optional[C.ProcessGroup]) -> None:
        self.buffers = [b for b in module.buffers() if not b.is_meta]
        self.group = group
        self._versions = [b._version for b in self.buffers]

    def sync(self) -> int:
        """Collective (every rank of ``group``); returns how many buffers were broadcast."""
        if not self.buffers or C.world_size(self.group) == 1:
            return 0
        sent = 0
        for i, b in enumerate(self.buffers):
            if b._version != self._versions[i]:
                C.broadcast(b.data, 0, self.group)
                sent += 1
                self._versions[i] = b._version
        return sent
