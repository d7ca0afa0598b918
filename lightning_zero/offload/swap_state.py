"""fp32 masters and optimizer states on NVMe (ZeRO-Infinity), swapped chunk by chunk around the step.

[Note: the chunk pipeline]
Each param group's shard is cut into chunks of ``chunk_numel`` elements; chunk ``c`` of the master
and of every optimizer state is one swap file (``g<group>.c<chunk>.<key>.swap``). The Adam step
walks the chunks through a read-ahead ring of three slots (ring.py, shared with the parameter
store): while chunk ``c`` is stepped in one slot, chunk ``c + 1`` is being read into the next and
chunk ``c - 1`` written from the previous one, so disk reads, CPU math and disk writes overlap (a
slot is reused only after its write has finished). The step waits for its last writes before returning: when ``step()`` is done
every swap file is complete and its checksum recorded.

Between steps the master tensors (the optimizer's parameters) and the optimizer's state tensors are
*placeholders*: same shape, storage resized to zero, so nothing reads stale values by accident.
``host_state()`` makes them real for checkpoints (read in, and written back out on exit, also when
a checkpoint load replaced the optimizer's state dict).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor

from lightning_zero.offload.nvme import NvmeSwapper, SwapOp
from lightning_zero.offload.pinned import aligned_empty
from lightning_zero.offload.ring import ReadAheadRing, Slot

RING = 3
"""Slots of the optimizer store's ring: the chunk being stepped, the next one being read, the last one being written."""


def make_placeholder(t: Tensor) -> Tensor:
    """Free ``t``'s storage in place (the tensor object, its shape and its identity remain)."""
    t.untyped_storage().resize_(0)
    return t


def take_storage(t: Tensor) -> Tensor:
    """Hand ``t``'s memory to a new tensor (returned: same dtype, shape and values, no copy) and leave
    ``t`` a placeholder (identity and shape kept, storage of its own, empty; :func:`make_resident`
    gives it memory again). The compact host states take the fp32 masters' memory this way instead of
    copying it (compact_state.py). The placeholder's storage is set at full size first (torch checks
    the bounds) and emptied at once: its pages are never touched, so they are never committed."""
    kept = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    fresh = torch.UntypedStorage((t.storage_offset() + t.numel()) * t.element_size())
    t.set_(fresh, t.storage_offset(), t.shape, t.stride())
    fresh.resize_(0)
    return kept


def make_resident(t: Tensor) -> Tensor:
    storage = t.untyped_storage()
    need = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.nbytes() < need:
        storage.resize_(int(need))
    return t


def is_placeholder(t: Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0 and t.numel() > 0


def chunk_ranges(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    return [(lo, min(numel, lo + chunk_numel)) for lo in range(0, numel, chunk_numel)]


class SwappedStore:
    """What the two NVMe stores share: ``host_state()``, a re-entrant block inside which everything is
    resident in host memory (checkpoints, user edits), swapped in on entry and out on the last exit."""

    resident: bool = False
    """Everything kept in host memory for good (teardown, when it fits): no swapping at all."""
    _depth: int = 0

    def _swap_in_all(self) -> None:
        raise NotImplementedError

    def _swap_out_all(self) -> None:
        raise NotImplementedError

    def keep_in_memory(self) -> None:
        """Bring everything into host memory for good (teardown); the swap files may then go."""
        if self.resident:
            return
        self._swap_in_all()
        self.resident = True

    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        if self.resident:
            yield
            return
        self._depth += 1
        if self._depth == 1:
            self._swap_in_all()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._swap_out_all()


AdamFn = Callable[[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]], None]
"""(master, grad, exp_avg, exp_avg_sq, out16) -> None: one Adam update of a chunk, in place."""


class NvmeOptimizerStore(SwappedStore):
    """Masters and shard-shaped optimizer states of every param group, on NVMe (see module note)."""

    def __init__(self, swapper: NvmeSwapper, masters: list[Tensor], optimizer: torch.optim.Optimizer,
                 chunk_numel: int, fraction: float = 1.0) -> None:
        self.swapper = swapper
        self.masters = masters
        self.optimizer = optimizer
        longest = max((m.numel() for m in masters), default=1)
        self.chunk_numel = max(1, min(chunk_numel, longest))
        self.chunks = [chunk_ranges(m.numel(), self.chunk_numel) for m in masters]
        self.in_memory: set[tuple[int, int]] = self._pick_in_memory(fraction)
        """(group, chunk) kept in host memory (``fraction`` < 1): stepped in place, never swapped."""
        self._mem: dict[tuple[int, int, str], Tensor] = {}
        self._has_state = [False] * len(masters)
        self.ring = ReadAheadRing(RING)
        self._depth = 0
        self.resident = False
        """True after ``keep_in_memory``: everything lives in host memory, the files are gone."""

    def _pick_in_memory(self, fraction: float) -> set[tuple[int, int]]:
        """The last chunks of every group, up to ``1 - fraction`` of all elements, stay in memory."""
        keep = int(round((1.0 - fraction) * sum(m.numel() for m in self.masters)))
        out: set[tuple[int, int]] = set()
        for gi, chunks in enumerate(self.chunks):
            for ci in reversed(range(len(chunks))):
                lo, hi = chunks[ci]
                if keep < hi - lo:
                    break
                out.add((gi, ci))
                keep -= hi - lo
        return out

    def _mem_chunk(self, gi: int, ci: int, key: str, dtype: torch.dtype = torch.float32) -> Tensor:
        k = (gi, ci, key)
        if k not in self._mem:
            lo, hi = self.chunks[gi][ci]
            self._mem[k] = aligned_empty(hi - lo, dtype)  # zeroed pages, kept from forked workers
        return self._mem[k]

    # ---------------------------------------------------------------- buffers and names
    @staticmethod
    def name(gi: int, ci: int, key: str) -> str:
        return f"g{gi}.c{ci}.{key}"

    def buffer_bytes(self) -> int:
        return self.ring.nbytes()

    def flush(self) -> None:
        """Wait for every write (and its checksum): afterwards every swap file is complete."""
        self.ring.drain()

    # ---------------------------------------------------------------- whole tensors
    def write_full(self, gi: int, key: str, t: Tensor) -> None:
        """Write a resident shard-shaped tensor to its chunk files (through the ring buffers)."""
        flat = t.reshape(-1)
        if key in ("exp_avg", "exp_avg_sq"):
            self._has_state[gi] = True
        for ci, (lo, hi) in enumerate(self.chunks[gi]):
            if (gi, ci) in self.in_memory:
                self._mem_chunk(gi, ci, key, t.dtype).copy_(flat[lo:hi])
                continue
            slot = self.ring.acquire()
            (buf,) = slot.views([(t.dtype, hi - lo)])
            buf.copy_(flat[lo:hi])
            self.ring.release(slot, [self.swapper.write(self.name(gi, ci, key), buf)])
        self.flush()

    def read_full(self, gi: int, key: str, t: Tensor) -> None:
        """Read a tensor's chunk files into it (zeros where it was never written)."""
        flat = t.reshape(-1)
        chunks = self.chunks[gi]
        pending: dict[int, tuple[Optional[Slot], Optional[Tensor], Optional[SwapOp]]] = {}

        def start(ci: int) -> None:
            if (gi, ci) in self.in_memory:
                pending[ci] = (None, None, None)
                return
            slot = self.ring.acquire()
            lo, hi = chunks[ci]
            name = self.name(gi, ci, key)
            (buf,) = slot.views([(t.dtype, hi - lo)])
            pending[ci] = (slot, buf, self.swapper.read(name, buf) if self.swapper.has(name) else None)

        try:
            for ci in range(min(RING - 1, len(chunks))):
                start(ci)
            for ci, (lo, hi) in enumerate(chunks):
                if ci + RING - 1 < len(chunks):
                    start(ci + RING - 1)
                slot, buf, op = pending[ci]
                if slot is None:
                    flat[lo:hi].copy_(self._mem_chunk(gi, ci, key, t.dtype))
                elif op is None:
                    flat[lo:hi].zero_()
                else:
                    op.wait()
                    assert buf is not None  # a started read has its slot's buffer
                    flat[lo:hi].copy_(buf)
                del pending[ci]
                if slot is not None:
                    self.ring.release(slot)
        except BaseException:
            self.ring.settle(op for _, _, op in pending.values())
            raise

    def swap_out_masters(self) -> None:
        """After the engine filled the masters: write them out and free their host memory."""
        for gi, m in enumerate(self.masters):
            self.write_full(gi, "master", m)
            make_placeholder(m)

    # ---------------------------------------------------------------- the step
    def adam_step(self, gi: int, grad: Tensor, out: Optional[Tensor], update: AdamFn,
                  limit: Optional[int] = None) -> None:
        """Run ``update`` over every chunk of group ``gi`` with reads, math and writes overlapped.

        ``grad`` and ``out`` are shard-shaped host tensors; a 16-bit ``out`` is written by
        ``update`` itself, an fp32 one is copied from the updated master chunk. ``limit`` (partial
        offload, device_share.py): only elements below it are stepped; the chunks beyond still go
        through the pipeline unchanged (they hold the device share's mirror), which keeps every
        swap file complete at the cost of their I/O.
        """
        keys = ("master", "exp_avg", "exp_avg_sq")
        chunks = self.chunks[gi]
        fresh_state = not self._has_state[gi]
        reads: dict[int, tuple[Optional[Slot], list[Tensor], list[SwapOp]]] = {}

        def start_read(ci: int) -> None:
            if (gi, ci) in self.in_memory:
                reads[ci] = (None, [self._mem_chunk(gi, ci, k) for k in keys], [])
                return
            slot = self.ring.acquire()
            lo, hi = chunks[ci]
            bufs = slot.views([(torch.float32, hi - lo)] * len(keys))
            ops = []
            for key, buf in zip(keys, bufs):
                if key != "master" and fresh_state:
                    buf.zero_()
                else:
                    ops.append(self.swapper.read(self.name(gi, ci, key), buf))
            reads[ci] = (slot, bufs, ops)

        try:
            self._step_chunks(gi, grad, out, update, chunks, keys, reads, start_read, limit)
        except BaseException:
            self.ring.settle(op for _, _, ops in reads.values() for op in ops)
            raise
        self._has_state[gi] = True
        self.flush()

    def _step_chunks(self, gi: int, grad: Tensor, out: Optional[Tensor], update: AdamFn, chunks: list,
                     keys: tuple[str, ...], reads: dict[int, tuple[Optional[Slot], list[Tensor], list[SwapOp]]],
                     start_read: Any, limit: Optional[int] = None) -> None:
        start_read(0)
        for ci, (lo, hi) in enumerate(chunks):
            if ci + 1 < len(chunks):
                start_read(ci + 1)  # overlaps this chunk's math and the previous chunk's write
            slot, (m, ea, eas), ops = reads[ci]
            for op in ops:  # popped once all are done: a failure settles the rest (adam_step)
                op.wait()
            del reads[ci]
            k = (hi if limit is None else max(lo, min(hi, limit))) - lo  # elements of this chunk to step
            if k:
                out16 = out[lo : lo + k] if out is not None and out.dtype != torch.float32 else None
                update(m[:k], grad[lo : lo + k], ea[:k], eas[:k], out16)
                if out is not None and out16 is None:
                    out[lo : lo + k].copy_(m[:k])
            if slot is not None:
                self.ring.release(slot, [self.swapper.write(self.name(gi, ci, k), b) for k, b in zip(keys, (m, ea, eas))])

    # ---------------------------------------------------------------- checkpoints and other readers
    def _state_keys(self, gi: int) -> list[str]:
        st = self.optimizer.state.get(self.masters[gi], {})
        n = self.masters[gi].numel()
        return [k for k, v in st.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n and n > 0]

    def _swap_in_all(self) -> None:
        """Masters and optimizer states into host memory (``host_state``)."""
        self.flush()
        for gi, m in enumerate(self.masters):
            self.read_full(gi, "master", make_resident(m))
            st = self.optimizer.state.get(m, {})
            for key in self._state_keys(gi):
                self.read_full(gi, key, make_resident(st[key]))

    def _swap_out_all(self) -> None:
        for gi, m in enumerate(self.masters):
            self.write_full(gi, "master", m)
            make_placeholder(m)
            st = self.optimizer.state.get(m)
            if not st:
                continue
            for key in self._state_keys(gi):
                value = st[key]
                self.write_full(gi, key, value)
                if value.untyped_storage().nbytes() == value.numel() * value.element_size() and value.storage_offset() == 0:
                    make_placeholder(value)
                else:  # a view or a tensor sharing storage (e.g. from a loaded state dict): our own placeholder
                    st[key] = make_placeholder(torch.empty(value.numel(), dtype=value.dtype))

    def placeholder_state(self, gi: int) -> dict:
        """The optimizer's Adam state for group ``gi`` (created as placeholders on the first step)."""
        m = self.masters[gi]
        st = self.optimizer.state[m]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = make_placeholder(torch.empty(m.numel(), dtype=torch.float32))
            st["exp_avg_sq"] = make_placeholder(torch.empty(m.numel(), dtype=torch.float32))
        return st

