"""Offloaded masters (stages 1-2) take the weights the user changes between steps.

[Note: offloaded masters take writes outside the optimizer]
zero/flat_group.py [Note: writes outside the optimizer] compares each rank's chunk of ``flat_param``
with its master before the step, on the device. Under ``offload_optimizer`` the masters are in host
memory (pinned, in compact states, behind NVMe swap files, or partly on the device: device_share.py),
so that comparison would copy the whole shard device-to-host before every step (2 bytes per
parameter per step in bf16, and a merge pass over the host master), for edits that most runs never
make. Instead :class:`ShardPrints` keeps a *fingerprint* of each bucket chunk of this rank's shard of
``flat_param``, taken on the device right after each write-back (the parameters then are the rounded
masters): each element's bit pattern times an odd position-dependent multiplier, summed modulo 2**32
per piece of ``PIECE`` elements, the pieces weighted by odd factors into an int64. Before the next step
(and before a state dict is read, and after ``gathered_params(writeback=True)``) the fingerprints are
taken again and compared in one small device-to-host read (8 bytes per bucket); the step during
backward checks at its first bucket and again at the step. Cost without an edit: two or three
device-side reads of this rank's 16-bit shard per step (2 bytes per parameter each; 11 ms for 16.8M
bf16 elements on one CPU thread, against 174 ms for the plain compare-and-merge there) and no transfer.
Only a chunk whose fingerprint changed is merged into its master with flat_group.py's rule (16-bit
compute: the elements that differ from the rounded master; fp32: the chunk): a device share's chunk
on the device, any other copied to the host first, inside ``host_state`` where the masters are not
plain host memory (NVMe swaps them in and out: an edit then costs a whole swap, once per edited step;
compact states expand and re-compress).
A change of one element always changes the fingerprint (an odd multiplier is invertible modulo 2**32,
and a 16- or 32-bit pattern that changed differs modulo 2**32); several changed elements leave it equal
only if their weighted differences cancel exactly modulo 2**32.

The rule is exact only while the parameters are the rounded masters. The delayed update steps the
masters one step ahead of the parameters (delayed.py), so a changed fingerprint there is refused; the
step during backward (eager.py) starts stepping at the first bucket, so the engine takes the writes
before it (flat.py) and refuses a change made after that (``on_after_backward``,
``on_before_optimizer_step``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.offload.device_share import DeviceShare
from lightning_zero.offload.swap_state import is_placeholder
from lightning_zero.zero.merge_writes import merge_param_writes

PIECE = 1 << 20
"""Elements per fingerprinted piece (each summed modulo 2**32, then weighted by an odd factor)."""
ROWS = 16
"""Pieces per kernel: bounds the int32 temporary at 64 MiB however large a bucket is, with few launches
(one piece per kernel was ~5 launches per MiB-element of the shard, 2-3 times a step)."""

_GOLDEN = -7046029254386353131
"""2**64 / golden ratio as a signed int64: spreads the position multipliers over all 64 bits."""


class ShardPrints:
    """Fingerprints of this rank's bucket chunks of each group's ``flat_param`` (see the note above)."""

    def __init__(self, groups: Sequence) -> None:
        self.groups = groups
        self._mult: Optional[Tensor] = None
        self._prints: Optional[list[Tensor]] = None

    def _chunks(self, gi: int) -> list[Tensor]:
        fg = self.groups[gi]
        return [fg.param_chunk(bi) for bi in range(len(fg.layout.buckets))]

    def _print(self, chunk: Tensor) -> Tensor:
        bits = chunk.view(torch.int16 if chunk.element_size() == 2 else torch.int32)
        if self._mult is None or self._mult.device != chunk.device:
            mult = torch.arange(PIECE, dtype=torch.int64, device=chunk.device).mul_(_GOLDEN).bitwise_or_(1)
            self._mult = mult.to(torch.int32)  # the low 32 bits: still odd
        acc = torch.zeros((), dtype=torch.int64, device=chunk.device)
        step = PIECE * ROWS
        for lo in range(0, bits.numel(), step):  # ROWS whole pieces per kernel (few launches), then the tail
            block = bits[lo : lo + step]
            rows, tail = divmod(block.numel(), PIECE)
            k0 = lo // PIECE
            if rows:
                # copy=True: a 32-bit chunk's int32 view is the parameters themselves
                terms = block[: rows * PIECE].to(torch.int32, copy=True).view(rows, PIECE).mul_(self._mult)
                weights = torch.arange(2 * k0 + 1, 2 * (k0 + rows), 2, dtype=torch.int64, device=chunk.device)
                acc.add_((terms.sum(1, dtype=torch.int32).to(torch.int64) * weights).sum())  # each piece mod 2**32
            if tail:
                term = block[rows * PIECE :].to(torch.int32, copy=True).mul_(self._mult[:tail]).sum(dtype=torch.int32)
                acc.add_(term.to(torch.int64) * (2 * (k0 + rows) + 1))
        return acc

    def take(self) -> list[Tensor]:
        """Every group's fingerprints (int64, one per bucket, on the device; no host sync)."""
        out = []
        for gi in range(len(self.groups)):
            chunks = self._chunks(gi)
            empty = torch.zeros(0, dtype=torch.int64, device=self.groups[gi].flat_param.device)
            out.append(torch.stack([self._print(c) for c in chunks]) if chunks else empty)
        return out

    def record(self, prints: Optional[list[Tensor]] = None) -> None:
        """The parameters are the rounded masters now (after a write-back, or after ``adopt``)."""
        self._prints = self.take() if prints is None else prints

    def changed(self) -> tuple[list[Tensor], list[tuple[int, int]]]:
        """(the fingerprints now, the (group, bucket) chunks that changed since ``record``): one small read."""
        now = self.take()
        if self._prints is None or not now:
            return now, []
        diff = torch.cat([a != b for a, b in zip(now, self._prints)]).tolist()  # one small device-to-host read
        keys = [(gi, bi) for gi, p in enumerate(now) for bi in range(p.numel())]
        out = [key for key, d in zip(keys, diff) if d]
        return now, out

    def adopt(self, chunks: list[tuple[int, int]], share: Optional[DeviceShare]) -> None:
        """Merge the changed chunks into their masters: a device share's on the device (and into the host
        mirror's tail where resident, which a ``host_state`` around this reads and pushes back), the others
        into the host masters (resident: NVMe and compact states need the caller inside ``host_state``)."""
        for gi, bi in chunks:
            fg = self.groups[gi]
            b = fg.layout.buckets[bi]
            live, host = fg.param_chunk(bi), fg.master_chunk(bi)
            if share is not None and share.owns(gi, b.shard_offset):
                g = share.group(gi)
                lo = b.shard_offset - g.split
                merge_param_writes(live, g.master[lo : lo + b.chunk])
                if g.out16 is not None:
                    g.out16[lo : lo + b.chunk].copy_(live)
                if not is_placeholder(fg.master):
                    host.copy_(g.master[lo : lo + b.chunk])
            else:
                merge_param_writes(live, host)

