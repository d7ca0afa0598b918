"""One param group under ZeRO-3: only shards persist; full unit buffers exist while gathered.

[Note: parameters keep their shape]
Each bucket (one unit's share of a param group) has a full-size buffer whose *storage* is resized to
zero when released and back when gathered (FSDP2's trick). Parameters are views into these buffers,
created once and never re-pointed, so ``p.shape``/``p.numel()`` stay true (Lightning's ModelSummary
counts correctly), autograd's saved views of a weight stay valid across release and re-gather, and
touching a released parameter fails loudly instead of reading stale values.

[Note: one rank aliases its partition]
A group partitioned over one rank (one data-parallel rank, or an expert group of one) has nothing to
gather: its partition is the whole of every bucket. Its full buffers are then views into the gather
source itself (the 16-bit partition, or the master when it is in the compute dtype), allocated once;
``allocate`` and ``free`` do nothing and the engine skips the all-gather, which on one GPU was a copy
of every weight twice per step (stage2.py [Note: one data-parallel rank]). The engine's bookkeeping
of what is gathered is unchanged, so reads outside a unit are found and refused as with many ranks
(read_watch.py, ``guard_released_modules``); only the storage stays allocated. Not with offload,
whose partitions live in host memory.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.parallel.dtensor import local_tensor, point_local
from lightning_zero.zero.flat_group import BufferFactory, ShardViews
from lightning_zero.zero.rebind import is_replaced, rebind
from lightning_zero.zero.partition import FlatLayout


class ShardedParamGroup(ShardViews):
    """Shards (fp32 master, 16-bit gather source) and releasable full buffers of one param group."""

    shares_master = False
    flat_grad: Optional[Tensor] = None
    flat_param: Optional[Tensor] = None

    def __init__(
        self,
        params: list[Parameter],
        layout: FlatLayout,
        shard: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        master_dtype: torch.dtype = torch.float32,
        master_factory: Optional[BufferFactory] = None,
        shard16_factory: Optional[BufferFactory] = None,
        alias: bool = False,
    ) -> None:
        """``shard16_factory`` (offload) always creates a separate gather source, even in fp32, where
        it may live elsewhere than the master (device or pinned host memory). ``alias``: the engine
        allows [Note: one rank aliases its partition], taken when the layout has one shard and the
        gather source is in the compute dtype on the compute device."""
        self.params = params
        self.layout = layout
        self.shard = shard
        self.compute_dtype = compute_dtype
        self.device = device
        if master_factory is not None:
            self.master = master_factory(layout.shard_numel, master_dtype)
        else:
            self.master = torch.zeros(layout.shard_numel, dtype=master_dtype, device=device)
        self.shard16: Optional[Tensor] = None
        if shard16_factory is not None:
            self.shard16 = shard16_factory(layout.shard_numel, compute_dtype)
        elif compute_dtype != master_dtype:
            self.shard16 = torch.zeros(layout.shard_numel, dtype=compute_dtype, device=device)
        src = self.shard16 if self.shard16 is not None else self.master
        self.aliased = (alias and layout.num_shards == 1 and src.dtype == compute_dtype
                        and src.device.type == torch.device(device).type)
        """Full buffers are views into the partition ([Note: one rank aliases its partition])."""
        self.full: list[Tensor] = []
        for b in layout.buckets:
            if self.aliased:
                self.full.append(src[b.shard_offset : b.shard_offset + b.chunk])
                continue
            buf = torch.empty(b.numel, dtype=compute_dtype, device=device)
            buf.untyped_storage().resize_(0)
            self.full.append(buf)
        self.grad_shard: Optional[Tensor] = None
        self._grad_written: set[int] = set()
        self._shapes: dict[int, torch.Size] = {}
        """Slot index -> its parameter's shape when :meth:`adopt` made it a view (:meth:`rebind_bucket`)."""

    def adopt(self, bucket_index: int) -> None:
        """Take the current (full) values of the bucket's parameters into the shards, then make every
        parameter a view into the (released) full buffer. Called once per bucket, unit by unit. A DTensor
        parameter's local TP shard is what is partitioned and viewed (parallel/dtensor.py [Note: ZeRO
        sees the local TP shard])."""
        b = self.layout.buckets[bucket_index]
        lo, hi = b.chunk_range(self.shard)
        for si in b.slots:
            slot = self.layout.slots[si]
            p = local_tensor(self.params[slot.index])
            a, z = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < z:
                src = p.detach().reshape(-1)[a - slot.offset : z - slot.offset]
                dst = b.shard_offset + (a - lo)
                self.master[dst : dst + (z - a)].copy_(src)
                if self.shard16 is not None:
                    self.shard16[dst : dst + (z - a)].copy_(src)
        buf = self.allocate(bucket_index)  # views can only be cut from allocated storage
        for si in b.slots:
            slot = self.layout.slots[si]
            p = local_tensor(self.params[slot.index])
            self._shapes[si] = p.shape
            point_local(self.params[slot.index], buf[slot.offset - b.start : slot.offset - b.start + slot.numel].view(p.shape))
        self.free(bucket_index)

    def rebind_bucket(self, bucket_index: int, names: dict[int, str]) -> None:
        """Inside ``gathered_params(writeback=True)``, the bucket gathered: a parameter given new storage there
        (``p.data = ...``) has its values copied into its view of the full buffer and becomes that view again, so
        the write-back takes them (rebind.py [Note: replaced parameter storage])."""
        b = self.layout.buckets[bucket_index]
        buf = self.full[bucket_index]
        base, size = buf.data_ptr() - b.start * buf.element_size(), buf.element_size()
        for si in b.slots:
            slot = self.layout.slots[si]
            p = self.params[slot.index]
            if slot.numel and si in self._shapes and is_replaced(p, base + slot.offset * size):
                rebind(p, buf[slot.offset - b.start : slot.offset - b.start + slot.numel], self._shapes[si],
                       names.get(id(p), f"parameter {slot.index}"))

    def gather_source(self, bucket_index: int) -> Tensor:
        """This rank's chunk of the bucket, in the compute dtype (what the all-gather sends)."""
        b = self.layout.buckets[bucket_index]
        src = self.shard16 if self.shard16 is not None else self.master
        return src[b.shard_offset : b.shard_offset + b.chunk]

    def allocate(self, bucket_index: int) -> Tensor:
        buf = self.full[bucket_index]
        if not self.aliased:
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        return buf

    def free(self, bucket_index: int) -> None:
        if not self.aliased:
            self.full[bucket_index].untyped_storage().resize_(0)

    def refresh_shard16(self) -> None:
        if self.shard16 is not None:
            self.shard16.copy_(self.master)

