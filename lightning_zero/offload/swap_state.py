"""fp32 masters and optimizer states on NVMe (ZeRO-Infinity), swapped chunk by chunk around the step.

[Note: the chunk pipeline]
Each param group's shard is cut into chunks of ``chunk_numel`` elements; chunk ``c`` of the master
and of every optimizer state is one swap file (``g<group>.c<chunk>.<key>.swap``). The Adam step
walks the chunks through a ring of three host buffer sets: while chunk ``c`` is stepped in slot
``c % 3``, chunk ``c + 1`` is being read into the next slot and chunk ``c - 1`` written from the
previous one, so disk reads, CPU math and disk writes overlap (a slot is reused only after its
write has finished). The step waits for its last writes before returning: when ``step()`` is done
every swap file is complete and its checksum recorded.

Between steps the master tensors (the optimizer's parameters) and the optimizer's state tensors are
*placeholders*: same shape, storage resized to zero, so nothing reads stale values by accident.
``host_state()`` makes them real for checkpoints (read in, and written back out on exit, also when
a checkpoint load replaced the optimizer's state dict).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterable, Optional

import torch
from torch import Tensor

from lightning_zero.offload.nvme import NvmeSwapper, SwapOp
from lightning_zero.offload.pinned import aligned_empty

RING = 3


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
        storage.resize_(need)
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
        self._bufs: dict[tuple[int, str, torch.dtype], Tensor] = {}
        self._slot_ops: dict[int, list[SwapOp]] = {s: [] for s in range(RING)}
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

    def _buf(self, slot: int, key: str, dtype: torch.dtype) -> Tensor:
        k = (slot, key, dtype)
        if k not in self._bufs:
            self._bufs[k] = aligned_empty(self.chunk_numel, dtype)
        return self._bufs[k]

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def _claim(self, slot: int) -> None:
        """Wait until the slot's previous reads/writes are done (and their checksums recorded)."""
        ops, self._slot_ops[slot] = self._slot_ops[slot], []
        for op in ops:
            op.wait()

    def flush(self) -> None:
        for slot in range(RING):
            self._claim(slot)

    def _settle(self, ops: Iterable[Optional[SwapOp]]) -> None:
        """After a failure: let every outstanding read/write finish (their threads use the ring buffers
        and hold file descriptors until then), ignoring their own errors; the first one is raised."""
        for op in [*ops, *(o for slot in range(RING) for o in self._slot_ops[slot])]:
            if op is None:
                continue
            try:
                op.wait()
            except Exception:  # noqa: BLE001 - the error being raised already says what failed
                pass
        self._slot_ops = {slot: [] for slot in range(RING)}

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
            slot = ci % RING
            self._claim(slot)
            buf = self._buf(slot, "io", t.dtype)[: hi - lo]
            buf.copy_(flat[lo:hi])
            self._slot_ops[slot].append(self.swapper.write(self.name(gi, ci, key), buf))
        self.flush()

    def read_full(self, gi: int, key: str, t: Tensor) -> None:
        """Read a tensor's chunk files into it (zeros where it was never written)."""
        flat = t.reshape(-1)
        chunks = self.chunks[gi]
        pending: dict[int, Optional[SwapOp]] = {}

        def start(ci: int) -> None:
            if (gi, ci) in self.in_memory:
                pending[ci] = None
                return
            slot = ci % RING
            self._claim(slot)
            lo, hi = chunks[ci]
            name = self.name(gi, ci, key)
            buf = self._buf(slot, "io", t.dtype)[: hi - lo]
            pending[ci] = self.swapper.read(name, buf) if self.swapper.has(name) else None

        try:
            for ci in range(min(RING - 1, len(chunks))):
                start(ci)
            for ci, (lo, hi) in enumerate(chunks):
                if ci + RING - 1 < len(chunks):
                    start(ci + RING - 1)
                op = pending.pop(ci)
                if (gi, ci) in self.in_memory:
                    flat[lo:hi].copy_(self._mem_chunk(gi, ci, key, t.dtype))
                elif op is None:
                    flat[lo:hi].zero_()
                else:
                    op.wait()
                    flat[lo:hi].copy_(self._buf(ci % RING, "io", t.dtype)[: hi - lo])
        except BaseException:
            self._settle(pending.values())
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
        reads: dict[int, list[SwapOp]] = {}

        def start_read(ci: int) -> None:
            if (gi, ci) in self.in_memory:
                reads[ci] = []
                return
            slot = ci % RING
            self._claim(slot)
            lo, hi = chunks[ci]
            ops = []
            for key in keys:
                buf = self._buf(slot, key, torch.float32)[: hi - lo]
                if key != "master" and fresh_state:
                    buf.zero_()
                else:
                    ops.append(self.swapper.read(self.name(gi, ci, key), buf))
            reads[ci] = ops

        try:
            self._step_chunks(gi, grad, out, update, chunks, keys, reads, start_read, limit)
        except BaseException:
            self._settle(op for ops in reads.values() for op in ops)
            raise
        self._has_state[gi] = True
        self.flush()

    def _step_chunks(self, gi: int, grad: Tensor, out: Optional[Tensor], update: AdamFn, chunks: list,
                     keys: tuple[str, ...], reads: dict[int, list[SwapOp]], start_read: Any,
                     limit: Optional[int] = None) -> None:
        start_read(0)
        for ci, (lo, hi) in enumerate(chunks):
            if ci + 1 < len(chunks):
                start_read(ci + 1)  # overlaps this chunk's math and the previous chunk's write
            for op in reads[ci]:  # popped once all are done: a failure settles the rest (adam_step)
                op.wait()
            del reads[ci]
            slot = ci % RING
            mem = (gi, ci) in self.in_memory
            m, ea, eas = (self._mem_chunk(gi, ci, k) if mem else self._buf(slot, k, torch.float32)[: hi - lo]
                          for k in keys)
            k = (hi if limit is None else max(lo, min(hi, limit))) - lo  # elements of this chunk to step
            if k:
                out16 = out[lo : lo + k] if out is not None and out.dtype != torch.float32 else None
                update(m[:k], grad[lo : lo + k], ea[:k], eas[:k], out16)
                if out is not None and out16 is None:
                    out[lo : lo + k].copy_(m[:k])
            if not mem:
                self._slot_ops[slot] = [self.swapper.write(self.name(gi, ci, k), b) for k, b in zip(keys, (m, ea, eas))]

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

