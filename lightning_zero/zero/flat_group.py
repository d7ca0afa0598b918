"""One optimizer param group turned into flat buffers: 16-bit parameters, fp32 master shard, gradients.

[Note: parameters are views]
Every trainable parameter's ``.data`` becomes a view into ``flat_param``, so the model runs
unchanged, one collective moves a whole bucket, and writing the updated shard back is a copy into
the buffer rather than a loop over tensors. The optimizer never sees these views: its param group
is re-pointed at ``master`` (the fp32 shard this rank owns), which is why any elementwise
``torch.optim.Optimizer`` works unchanged, with its own hyper-parameters, LR schedulers included.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.parallel.dtensor import grad_like, local_tensor, point_local
from lightning_zero.zero.merge_writes import merge_param_writes
from lightning_zero.zero.partition import FlatLayout
from lightning_zero.zero.rebind import is_replaced, rebind

BufferFactory = Callable[[int, torch.dtype], Tensor]
"""Allocates a zeroed 1-D buffer of ``numel`` elements (offload passes pinned host memory)."""


class ShardViews:
    """Views shared by every param-group storage (stages 0-2 here, stage 3 in sharded_group.py).

    Needs ``layout``, ``params``, ``master``, ``device`` and ``grad_shard`` attributes.
    """

    layout: FlatLayout
    params: list[Parameter]
    master: Tensor
    device: torch.device
    grad_shard: Optional[Tensor]
    grad_dtype: Optional[torch.dtype] = None
    """dtype of ``grad_shard``; None: the master's (16-bit device states keep fp32 gradients: zero/states16.py)."""
    _grad_written: set[int]
    """Buckets reduced into ``grad_shard`` since it was dropped (:meth:`add_to_grad_shard`)."""

    def rebind_params(self, names: dict[int, str], training: bool = True) -> None:
        """Stages 0-2: :meth:`FlatParamGroup.rebind_params`; stage 3 refuses replaced storage at the release
        (rebind.py [Note: replaced parameter storage])."""

    def adopt_param_writes(self, comp: Optional[Tensor] = None) -> None:
        """Stage 3 keeps no full copy between steps: a unit changed in place is refused (inplace_guard.py
        [Note: in-place writes outside the optimizer]). Stages 0-2: :meth:`FlatParamGroup.adopt_param_writes`."""

    def param_view(self, slot_index: int, buffer: Tensor, base: int = 0) -> Tensor:
        """Parameter ``slot_index``'s piece of a flat buffer that starts at flat offset ``base``."""
        slot = self.layout.slots[slot_index]
        p = local_tensor(self.params[slot.index])  # a DTensor's local TP shard (parallel/dtensor.py)
        return buffer[slot.offset - base : slot.offset - base + slot.numel].view(p.shape)

    def master_chunk(self, bucket_index: int) -> Tensor:
        """This rank's piece of bucket ``bucket_index`` in the master shard (with one shard, the
        chunk is the whole bucket and ``shard_offset`` its start)."""
        b = self.layout.buckets[bucket_index]
        return self.master[b.shard_offset : b.shard_offset + b.chunk]

    def add_to_grad_shard(self, bucket_index: int, values: Tensor) -> None:
        """Accumulate a reduced bucket chunk into the fp32 gradient shard. The shard is allocated
        uninitialised and a chunk's first reduction since :meth:`drop_grad_shard` is copied, not added
        to zeros: zeroing the shard and adding into it read and wrote it twice more. Every bucket is
        reduced in every backward (engine.py [Note: launch in bucket order]), so the whole shard is
        written before anything reads it."""
        chunk, accumulate = self.grad_chunk_to_write(bucket_index)
        if accumulate:
            chunk.add_(values)
        else:
            chunk.copy_(values)

    def grad_chunk_to_write(self, bucket_index: int) -> tuple[Tensor, bool]:
        """Bucket ``bucket_index``'s chunk of the gradient shard and whether a reduction adds to it (False:
        the first since :meth:`drop_grad_shard`, which overwrites it: :meth:`add_to_grad_shard`); the caller
        writes it now. qgZ's reductions write there themselves (comm/quantized.py [Note: qgZ into the
        gradient shard])."""
        b = self.layout.buckets[bucket_index]
        chunk = self.ensure_grad_shard(zeroed=False)[b.shard_offset : b.shard_offset + b.chunk]
        accumulate = bucket_index in self._grad_written
        self._grad_written.add(bucket_index)
        return chunk, accumulate

    def drop_grad_shard(self) -> None:
        """Discard the accumulated gradients (after a step, or a skipped one)."""
        self.grad_shard = None
        self._grad_written.clear()

    def ensure_grad_shard(self, zeroed: bool = True) -> Tensor:
        """The fp32 gradient shard, allocated on first use: zeroed, or (``zeroed=False``, for a caller that
        writes every element before it is read: stage2.py's [Note: one data-parallel rank]) uninitialised."""
        if self.grad_shard is None:
            make = torch.zeros if zeroed else torch.empty
            dtype = self.grad_dtype or self.master.dtype
            self.grad_shard = make(self.layout.shard_numel, dtype=dtype, device=self.device)
        return self.grad_shard


class FlatParamGroup(ShardViews):
    """Flat storage of one param group on one rank."""

    def __init__(
        self,
        params: list[Parameter],
        layout: FlatLayout,
        shard: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        master_dtype: torch.dtype = torch.float32,
        master_factory: Optional[BufferFactory] = None,
    ) -> None:
        self.params = params
        self.layout = layout
        self.shard = shard
        self.compute_dtype = compute_dtype
        self.device = device
        self.flat_param = torch.zeros(layout.total, dtype=compute_dtype, device=device)
        self.shares_master = layout.num_shards == 1 and compute_dtype == master_dtype and master_factory is None
        if self.shares_master:
            self.master = self.flat_param
        elif master_factory is not None:
            self.master = master_factory(layout.shard_numel, master_dtype)
        else:
            self.master = torch.zeros(layout.shard_numel, dtype=master_dtype, device=device)
        # master first, from the original (full precision) values, then the 16-bit copy.
        for index, start, shard_start, length in layout.param_pieces_in_shard(shard if layout.num_shards > 1 else 0):
            src = local_tensor(params[index]).detach().reshape(-1)[start : start + length]
            if not self.shares_master:
                self.master[shard_start : shard_start + length].copy_(src)
        for slot in layout.slots:
            p = local_tensor(params[slot.index])  # parallel/dtensor.py [Note: ZeRO sees the local TP shard]
            view = self.flat_param[slot.offset : slot.offset + slot.numel].view(p.shape)
            view.copy_(p.detach())
            point_local(params[slot.index], view)  # a DTensor takes the compute dtype too
        self._shapes = [local_tensor(params[slot.index]).shape for slot in layout.slots]
        """Each slot's parameter shape at setup (:meth:`rebind_params`)."""
        self.flat_grad: Optional[Tensor] = None
        """Full gradient buffer (stages 0 and 1); parameters' ``.grad`` are views into it."""
        self.grad_shard: Optional[Tensor] = None
        """fp32 reduced gradients of this rank's shard (stages 1 and 2), accumulated over micro-batches."""
        self._grad_written = set()
        self._grad_views: Optional[tuple[Tensor, list[Optional[Tensor]]]] = None
        """(the ``flat_grad`` they view, each slot's view or None): :meth:`grad_view`."""

    # --- views --------------------------------------------------------------------------------
    def bucket_view(self, buffer: Tensor, bucket_index: int) -> Tensor:
        b = self.layout.buckets[bucket_index]
        return buffer[b.start : b.end]

    def rebind_params(self, names: dict[int, str], training: bool = True) -> None:
        """Parameters whose ``.data`` was replaced become views of ``flat_param`` again, with the values they
        were given (rebind.py [Note: replaced parameter storage]); :meth:`adopt_param_writes` then takes them.
        ``training=False`` (a state dict read, maybe after fit): only storage on ``flat_param``'s device and in
        its dtype, as training code gives; a module handed back after fit (moved to the CPU, or given its fp32
        masters: after_fit.py) is left as it is."""
        flat = self.flat_param
        base, size = flat.data_ptr(), flat.element_size()
        for i, slot in enumerate(self.layout.slots):
            p = self.params[slot.index]
            if slot.numel and is_replaced(p, base + slot.offset * size):
                local = local_tensor(p)
                if not training and (local.device != flat.device or local.dtype != flat.dtype):
                    continue
                rebind(p, self.flat_param[slot.offset : slot.offset + slot.numel], self._shapes[i],
                       names.get(id(p), f"parameter {slot.index}"))

    def adopt_param_writes(self, comp: Optional[Tensor] = None) -> None:
        """[Note: writes outside the optimizer] The model's parameters are views of ``flat_param``; the
        optimizer steps ``master`` and the write-back overwrites ``flat_param`` from it. Code that
        changes a parameter between two steps (WGAN weight clipping ``p.data.clamp_()``, CLIP's
        ``logit_scale.clamp_()``, any ``torch.no_grad()`` edit) changed only the view, so the next
        write-back silently undid it, where ddp's optimizer steps from the changed value. Before each
        step every rank copies the changes in its own chunks into its master (every rank made the same
        change, as under ddp): fp32 compute copies the chunk (equal elements stay equal); 16-bit
        compute takes only elements that differ from the rounded master, so untouched elements keep
        their fp32 bits. One pass over this rank's shard (merge_writes.py: one fused kernel on CUDA), no
        host sync. ``.data`` edits leave no version-counter trace, hence the comparison rather than a
        check of ``_version``. 16-bit device
        states (states16.py): the bf16 master is what the parameters were written from, so the chunk is
        copied, and ``comp`` (a ``bf16_kahan`` compensation, laid out as the master) is zeroed where an
        element changed: the value the user set is exact, as a checkpoint load restarts the words."""
        if self.shares_master:  # the parameters are the master
            return
        for bi, b in enumerate(self.layout.buckets):
            live, master = self.param_chunk(bi), self.master_chunk(bi)
            if comp is not None:
                comp[b.shard_offset : b.shard_offset + b.chunk].masked_fill_(live != master, 0)
            merge_param_writes(live, master)

    def param_chunk(self, bucket_index: int) -> Tensor:
        """This rank's chunk of bucket ``bucket_index`` in ``flat_param`` (the parameters' values that
        :meth:`master_chunk` holds the master of)."""
        lo, hi = self.layout.buckets[bucket_index].chunk_range(self.shard if self.layout.num_shards > 1 else 0)
        return self.flat_param[lo:hi]

    # --- gradient storage -----------------------------------------------------------------------
    def attach_full_grad(self, dtype: torch.dtype) -> None:
        """Allocate the full gradient buffer and point every ``param.grad`` at its view."""
        self.flat_grad = torch.zeros(self.layout.total, dtype=dtype, device=self.device)
        for i in range(len(self.layout.slots)):
            p = self.params[self.layout.slots[i].index]
            p.grad = grad_like(p, self.grad_view(i))

    def grad_view(self, slot_index: int) -> Tensor:
        """Parameter ``slot_index``'s view of ``flat_grad``, made once: the gradient hook asks for it per
        parameter and per backward (every micro-batch of a pipeline), and slicing a fresh view each time
        was the largest host cost of the hook. Rebuilt if ``flat_grad`` is replaced."""
        assert self.flat_grad is not None
        cached = self._grad_views
        if cached is None or cached[0] is not self.flat_grad:
            cached = self._grad_views = (self.flat_grad, [None] * len(self.layout.slots))
        view = cached[1][slot_index]
        if view is None:
            view = cached[1][slot_index] = self.param_view(slot_index, self.flat_grad)
        return view
