"""Module buffers kept equal across data-parallel ranks, as DDP's ``broadcast_buffers`` keeps them.

[Note: buffer sync]
Buffers are not parameters: ZeRO neither partitions nor reduces them. Most never change (masks,
rotary tables); some change in every training forward on each rank's own data (BatchNorm's running
statistics). DDP broadcasts rank 0's buffers before every forward, so every rank evaluates with rank
0's statistics; without the same, validation under ZeRO would differ from ``ddp`` rank by rank.
Before each step, :class:`BufferSync` asks which buffers changed since the last sync (their version
counters; one small all-reduce so every rank agrees on the list) and broadcasts those from rank 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_zero.comm import collectives as C


class BufferSync:
    """Broadcast changed buffers of ``module`` from data-parallel rank 0 (see the note)."""

    def __init__(self, module: nn.Module, group: Optional[C.ProcessGroup], device: torch.device) -> None:
        self.buffers = [b for b in module.buffers() if not b.is_meta]
        self.group = group
        self.device = device
        self._versions = [b._version for b in self.buffers]

    def sync(self) -> int:
        """Collective (every rank of ``group``); returns how many buffers were broadcast."""
        if not self.buffers or C.world_size(self.group) == 1:
            return 0
        changed = torch.tensor([int(b._version != v) for b, v in zip(self.buffers, self._versions)],
                               dtype=torch.int32, device=C.device_for(self.group, self.device))
        C.all_reduce(changed, self.group, "max")
        sent = 0
        for b, flag in zip(self.buffers, changed.tolist()):
            if flag:
                C.broadcast(b.data, 0, self.group)
                sent += 1
        self._versions = [b._version for b in self.buffers]
        return sent
