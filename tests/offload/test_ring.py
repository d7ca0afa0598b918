"""The read-ahead ring (offload/ring.py): slot order, read-ahead and eviction, errors, and the bound it
puts on the NVMe parameter store's staging memory in a real run."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.offload.nvme import SwapOp
from lightning_zero.offload.pinned import ALIGN
from lightning_zero.offload.ring import ReadAheadRing, Slot, request_bytes
from tests.helpers.parity_model import DIM, Block, ParityNet
from tests.offload.helpers import fit

NVME_PARAMS = dict(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_chunk_mb=0.004)


class FakeIO:
    """Reads that fill a view with a value when waited for (or raise), and a log of what was waited."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.reads = 0

    def read(self, value: float, fail: bool = False) -> Callable[[Slot], list[SwapOp]]:
        def start(slot: Slot) -> list[SwapOp]:
            self.reads += 1
            (view,) = slot.views([(torch.float32, 8)])

            def finish() -> None:
                self.log.append(f"read {value}")
                if fail:
                    raise OSError(f"read {value} failed")
                view.fill_(value)

            return [SwapOp(finish)]

        return start

    def write(self, name: str, fail: bool = False) -> SwapOp:
        def finish() -> None:
            self.log.append(f"write {name}")
            if fail:
                raise OSError(f"write {name} failed")

        return SwapOp(finish)


def test_views_are_aligned_and_disjoint() -> None:
    ring = ReadAheadRing(1)
    slot = ring.acquire()
    request = [(torch.float32, 5), (torch.bfloat16, 4097), (torch.uint8, 1)]
    views = slot.views(request)
    assert [v.dtype for v in views] == [torch.float32, torch.bfloat16, torch.uint8]
    assert [v.numel() for v in views] == [5, 4097, 1]
    starts = [v.data_ptr() for v in views]
    assert all(p % ALIGN == 0 for p in starts)
    for v, nxt in zip(views, starts[1:]):  # each view owns whole blocks up to the next one
        assert v.data_ptr() + v.numel() * v.element_size() <= nxt
    assert ring.nbytes() == request_bytes(request) == ALIGN + 3 * ALIGN + ALIGN
    slot.views([(torch.float32, 2)])  # a smaller request reuses the arena
    assert ring.nbytes() == request_bytes(request)


def test_least_recently_released_first_and_writes_waited_before_reuse() -> None:
    io, ring = FakeIO(), ReadAheadRing(2)
    a = ring.acquire()
    b = ring.acquire()
    with pytest.raises(RuntimeError, match="all 2 slots"):
        ring.acquire()
    ring.release(b, [io.write("b")])
    ring.release(a, [io.write("a")])
    assert ring.acquire() is b and io.log == ["write b"]  # b was released first; its write is finished first
    ring.drain()
    assert io.log == ["write b", "write a"]


def test_a_failed_write_raises_when_its_slot_is_reused_and_leaves_the_slot_free() -> None:
    io, ring = FakeIO(), ReadAheadRing(1)
    slot = ring.acquire()
    ring.release(slot, [io.write("x", fail=True)])
    with pytest.raises(OSError, match="write x failed"):
        ring.acquire()
    assert ring.acquire() is slot  # released again after the error: the ring is not wedged


def test_read_ahead_then_take_reads_once() -> None:
    io, ring = FakeIO(), ReadAheadRing(3)
    ring.read_ahead("k", io.read(1.0))
    ring.read_ahead("k", io.read(99.0))  # already ahead: no second read
    assert ring.holds("k") and io.reads == 1
    slot = ring.take("k", io.read(99.0))
    assert not ring.holds("k") and io.reads == 1
    assert torch.equal(slot.views([(torch.float32, 8)])[0], torch.full((8,), 1.0))
    ring.release(slot)
    slot = ring.take("j", io.read(2.0))  # not read ahead: read now
    assert io.reads == 2 and torch.equal(slot.views([(torch.float32, 8)])[0], torch.full((8,), 2.0))


def test_free_slots_are_used_before_read_aheads_are_evicted() -> None:
    io, ring = FakeIO(), ReadAheadRing(2)
    ring.read_ahead("old", io.read(1.0))  # the oldest release ...
    spare = ring.acquire()
    ring.release(spare)  # ... and a newer, empty slot
    ring.read_ahead("new", io.read(2.0))
    assert ring.holds("old") and ring.holds("new") and ring.evicted == 0  # the empty slot went, no guess lost
    ring.acquire()  # now every free slot holds a guess: the oldest one goes
    assert not ring.holds("old") and ring.holds("new") and ring.evicted == 1
    assert "read 1.0" in io.log  # its I/O was finished before the slot was reused


def test_read_errors_raise_at_take_and_are_ignored_for_evicted_guesses() -> None:
    io, ring = FakeIO(), ReadAheadRing(1)
    ring.read_ahead("bad", io.read(1.0, fail=True))
    with pytest.raises(OSError, match="read 1.0 failed"):
        ring.take("bad", io.read(1.0))
    ring.read_ahead("stale", io.read(2.0, fail=True))
    ring.acquire()  # evicts the failed guess without raising
    assert ring.evicted == 1


def test_drain_leaves_read_aheads_to_their_take_and_settle_forgets_them() -> None:
    io, ring = FakeIO(), ReadAheadRing(2)
    ring.read_ahead("bad", io.read(1.0, fail=True))
    ring.drain()  # waits writes only: the failed read is still reported by take
    with pytest.raises(OSError, match="read 1.0 failed"):
        ring.take("bad", io.read(1.0))
    ring.read_ahead("bad2", io.read(3.0, fail=True))
    held = ring.acquire()
    ring.settle()  # after a failure: everything finished, errors swallowed, guesses forgotten, slots free
    assert not ring.holds("bad2") and not held.held
    slot = ring.take("bad2", io.read(3.0))  # read again, not served from the swallowed failure
    assert torch.equal(slot.views([(torch.float32, 8)])[0], torch.full((8,), 3.0))


class DeepNet(ParityNet):
    """ParityNet with 8 blocks: more stage-3 units than the ring has slots for."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(DIM) for _ in range(8)])


class RingWatch(pl.Callback):
    """The stage-3 NVMe parameter store's ring after every step, and what the partitions hold."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []
        self.evicted: list[int] = []
        self.slots = self.chunks = self.slot_bytes = self.partition_bytes = self.fetched = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.engines[0]
        store = engine._param_store
        chunks = [b.chunk * 4 for fg in engine.groups for b in fg.layout.buckets]  # fp32 run: 4 B each
        self.chunks, self.partition_bytes = len(chunks), sum(chunks)
        self.slots = len(store.ring.slots)
        self.slot_bytes = -(-max(chunks) // ALIGN) * ALIGN
        self.nbytes.append(store.ring.nbytes())
        self.evicted.append(store.ring.evicted)
        self.fetched = store.fetched_bytes


def test_parameter_staging_is_bounded_by_the_ring_and_no_read_ahead_is_wasted(tmp_path: Path) -> None:
    watch = RingWatch()
    fit(steps=4, callbacks=[watch], model=DeepNet(), nvme_path=str(tmp_path), **NVME_PARAMS)
    assert watch.slots < watch.chunks  # the ring stages fewer chunks than the partition has ...
    assert watch.fetched >= 2 * 4 * watch.partition_bytes  # ... while every step reads all of them twice ...
    assert 0 < max(watch.nbytes) <= watch.slots * watch.slot_bytes  # ... through slots counted here
    assert watch.evicted == [0] * len(watch.evicted)  # deep enough: every read-ahead was used by its gather
