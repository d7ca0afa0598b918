"""The read-ahead ring: a fixed set of host staging slots that every NVMe read lands in and every
NVMe write leaves from.

[Note: the read-ahead ring]
Both NVMe stores stream chunks through host memory: the optimizer store (swap_state.py) reads a
chunk of masters and moments, steps it and writes it back while the next chunk is being read; the
parameter store (params.py) reads the 16-bit chunks of the units the stage-3 prefetch will gather
next, and writes them back after the step. Both used to keep their own buffers and their own
bookkeeping of what was still in flight (three fixed buffer sets for one, a fresh pinned buffer per
read for the other, so the staging memory of parameter reads had no bound). This ring is the one
mechanism both use now, each store with its own ring sized for its pattern:

* a **slot** owns one aligned host arena (pinned when its contents go to a GPU) that grows to the
  largest request it served; a request carves 4 KiB-aligned views out of it (``Slot.views``), so
  direct I/O can read and write whole blocks into each view;
* ``acquire`` hands out the least recently used free slot that holds no read-ahead (the oldest
  read-ahead only when every free slot holds one), after its previous I/O has finished (a
  failed write raises there: training must not go on over a swap file that was not written) and
  after the device copy that read it last has finished (``release(..., done=event)``);
* ``read_ahead(key, ...)`` starts a speculative read into a slot and leaves the slot free: a later
  ``take(key)`` claims it (waiting for the read; its errors raise), and if the ring needs the slot
  first, the read-ahead is *evicted*: its I/O is waited for, its error ignored and the key
  forgotten, so a wrong guess costs a re-read, never a wrong value or a deadlock;
* ``settle`` waits every outstanding operation after a failure, ignoring their errors, because
  their threads write into the arenas and hold file descriptors until they finish.

One thread uses a ring at a time (the stores are driven by the engine's step or its gathers, not
both at once); it holds no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.offload.nvme import SwapOp
from lightning_zero.offload.pinned import ALIGN, aligned_empty, round_up

Request = Sequence[tuple[torch.dtype, int]]
"""The views a user of one slot needs: (dtype, numel) each, laid out one after another."""


def request_bytes(request: Request) -> int:
    """Arena bytes for ``request``: every view starts on an ``ALIGN`` boundary and owns whole blocks."""
    return sum(round_up(max(n * torch.empty((), dtype=dt).element_size(), 1), ALIGN) for dt, n in request)


@dataclass(eq=False)
class Slot:
    """One staging arena and what is still using it."""

    index: int
    pin: bool
    arena: Optional[Tensor] = None
    ops: list[SwapOp] = field(default_factory=list)
    """Reads into or writes from the arena still in flight."""
    done: Any = None
    """An event recorded after the last device copy out of the arena (CUDA), or None."""
    key: Optional[Hashable] = None
    """The read-ahead this slot holds for a later ``take``; None once taken or evicted."""
    held: bool = False

    def views(self, request: Request) -> list[Tensor]:
        """Tensors of the requested dtypes and sizes, one after another in the arena (grown if needed)."""
        need = request_bytes(request)
        if self.arena is None or self.arena.numel() < need:
            self.arena = aligned_empty(need, torch.uint8, pin=self.pin)
        out, off = [], 0
        for dt, n in request:
            nbytes = n * torch.empty((), dtype=dt).element_size()
            out.append(self.arena[off : off + nbytes].view(dt))
            off += round_up(max(nbytes, 1), ALIGN)
        return out

    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def wait(self, raise_errors: bool = True) -> None:
        """Finish the slot's I/O and its last device copy."""
        ops, self.ops = self.ops, []
        first: Optional[BaseException] = None
        for op in ops:  # all of them, also after a failure: their threads still use the arena
            try:
                op.wait()
            except Exception as err:  # noqa: BLE001 - re-raised below (or ignored, for an evicted guess)
                first = first or err
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        if first is not None and raise_errors:
            raise first


class ReadAheadRing:
    """``depth`` staging slots handed out least recently used first (see [Note: the read-ahead ring])."""

    def __init__(self, depth: int, pin: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"a read-ahead ring needs at least one slot, got depth={depth}")
        self.slots = [Slot(i, pin) for i in range(depth)]
        self._free: OrderedDict[int, Slot] = OrderedDict((s.index, s) for s in self.slots)
        """Free slots, least recently released first (read-aheads included: they may be evicted)."""
        self._ahead: dict[Hashable, Slot] = {}
        self.evicted = 0
        """Read-aheads dropped before they were taken (each costs a re-read): a ring too shallow shows here."""

    # ---------------------------------------------------------------- slots
    def acquire(self) -> Slot:
        """The least recently used free slot, held: its I/O and device copy finished, any read-ahead
        it held evicted. Raises an earlier write's error from that slot."""
        if not self._free:
            raise RuntimeError(f"all {len(self.slots)} slots of the read-ahead ring are held: a slot was not released")
        # A slot holding no read-ahead first; only when every free slot holds one, the oldest guess goes.
        slot = next((s for s in self._free.values() if s.key is None), None) or next(iter(self._free.values()))
        if slot.key is not None:  # a guess nobody took in time
            self._ahead.pop(slot.key, None)
            slot.key = None
            self.evicted += 1
            slot.wait(raise_errors=False)
        return self._hold(slot)

    def _hold(self, slot: Slot) -> Slot:
        """Take a free ``slot`` out of the free list once its I/O is done; on an I/O error it stays free."""
        slot.wait()
        del self._free[slot.index]
        slot.held = True
        return slot

    def release(self, slot: Slot, ops: Iterable[SwapOp] = (), done: Any = None) -> None:
        """Give ``slot`` back; it is reused only after ``ops`` (its writes) and ``done`` finish."""
        slot.ops.extend(ops)
        if done is not None:
            slot.done = done
        slot.held = False
        self._free[slot.index] = slot
        self._free.move_to_end(slot.index)

    # ---------------------------------------------------------------- keyed read-ahead
    def holds(self, key: Hashable) -> bool:
        return key in self._ahead

    def read_ahead(self, key: Hashable, start: Callable[[Slot], list[SwapOp]]) -> None:
        """Start ``start(slot)``'s reads for ``key`` in a free slot, unless already ahead."""
        if key in self._ahead:
            return
        slot = self.acquire()
        try:
            ops = start(slot)
        except BaseException:
            self.release(slot)
            raise
        slot.key = key
        self._ahead[key] = slot
        self.release(slot, ops)

    def take(self, key: Hashable, start: Callable[[Slot], list[SwapOp]]) -> Slot:
        """``key``'s slot, held, with its reads finished (started now if it was not read ahead)."""
        self.read_ahead(key, start)
        slot = self._ahead.pop(key)
        slot.key = None
        return self._hold(slot)

    def evict(self, key: Hashable) -> None:
        """Forget ``key``'s read-ahead (its file is about to change), after its I/O finished."""
        slot = self._ahead.pop(key, None)
        if slot is not None:
            slot.key = None
            slot.wait(raise_errors=False)

    def evict_all(self) -> None:
        for key in list(self._ahead):
            self.evict(key)

    # ---------------------------------------------------------------- whole ring
    def drain(self) -> None:
        """Wait for every free slot's writes (their errors raise): afterwards every file is complete.
        Read-aheads are left running: their reads are waited for (and their errors raised) at ``take``."""
        for slot in self.slots:
            if not slot.held and slot.key is None:
                slot.wait()

    def settle(self, extra: Iterable[Optional[SwapOp]] = ()) -> None:
        """After a failure: finish ``extra`` and every slot's I/O, ignoring their errors (the failure
        being raised already says what went wrong); held slots are released."""
        for op in extra:
            if op is not None:
                try:
                    op.wait()
                except Exception:  # noqa: BLE001 - see docstring
                    pass
        for slot in self.slots:
            slot.wait(raise_errors=False)
            if slot.held:
                self.release(slot)
        for key in list(self._ahead):  # their reads' errors were just swallowed: never hand their data out
            self._ahead.pop(key).key = None

    def nbytes(self) -> int:
        """Host bytes of the arenas (the staging memory the estimator counts)."""
        return sum(s.nbytes() for s in self.slots)
