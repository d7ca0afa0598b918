"""The communication backend a 1-bit optimizer is handed: compressed averaging over one process group.

The optimizer never reaches for a process group or the strategy: ``ZeroStrategy`` builds a
:class:`TorchDistBackend` over its data-parallel group and hands it to the optimizer
(``set_comm_backend``); tests and users may hand any object with the same interface
(:class:`CompressedBackend`). There is one implementation for every transport: it calls only
:mod:`lightning_zero.comm.collectives` (all-to-all, all-gather, send/recv), which runs on gloo for
CPU tensors and NCCL for CUDA tensors alike; the sign packing picks the CPU or CUDA kernel by the
tensor's device.

[Note: counting bytes]
``counters.bytes_sent`` is what this rank puts on the wire under bandwidth-optimal algorithms
(NCCL's rings): an all-to-all of B input bytes sends (N-1)/N * B, an all-gather of B input bytes
sends (N-1) * B, an all-reduce of B bytes sends 2 (N-1)/N * B (:func:`wire_bytes`). It is the
figure to compare with a 16-bit all-reduce of the same vector (:func:`allreduce_bytes`).
``counters.bytes_handed`` is the plain size of the tensors handed to torch.distributed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed.onebit_allreduce import (
    ErrorFeedback,
    OneBitLayout,
    decompress_gathered,
    server_reduce,
    worker_compress,
)
from lightning_zero.comm.compressed.sign import SignCompressor, default_compressor

DEFAULT_BLOCK = 1024
"""Elements per scale: 4 bytes of scale per 128 bytes of signs (3% overhead) and a scale local
enough to follow magnitude changes along the flat momentum (DeepSpeed uses one per rank chunk)."""


def wire_bytes(op: str, input_bytes: int, world: int) -> float:
    """Bytes one rank sends for a collective under a bandwidth-optimal algorithm (see the Note)."""
    if world <= 1:
        return 0.0
    factor = {
        "all_reduce": 2.0 * (world - 1) / world,
        "all_to_all": (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "all_gather": float(world - 1),
        "send": 1.0,
    }
    return factor[op] * input_bytes


def allreduce_bytes(numel: int, world: int, element_size: int = 2) -> float:
    """What one rank sends for an uncompressed all-reduce of ``numel`` elements (16-bit by default)."""
    return wire_bytes("all_reduce", numel * element_size, world)


@dataclass
class CommCounters:
    """Running totals of one backend (per rank)."""

    calls: int = 0
    bytes_sent: float = 0.0
    """Wire bytes this rank sent (see [Note: counting bytes])."""
    bytes_handed: int = 0
    """Bytes of the input tensors handed to torch.distributed."""
    reference_bytes: float = 0.0
    """What 16-bit all-reduces of the same vectors would have sent."""
    kernel_s: float = 0.0
    """Seconds in compression/decompression (measured only with ``time_kernels=True``)."""
    comm_s: float = 0.0
    """Seconds in the two collectives (measured only with ``time_kernels=True``)."""


class CompressedBackend(Protocol):
    """What a 1-bit optimizer needs from its communication backend."""

    world_size: int
    rank: int
    counters: CommCounters

    def new_errors(self, numel: int, device: torch.device) -> ErrorFeedback:
        """Zero error buffers for a vector of ``numel`` elements."""
        ...

    def compressed_average_(self, tensor: Tensor, errors: ErrorFeedback) -> Tensor:
        """Replace ``tensor`` (flat fp32) by the error-compensated 1-bit average over the ranks."""
        ...

    def gather_to_root(self, tensor: Tensor) -> Optional[list[Tensor]]:
        """Every rank's ``tensor`` (same shape everywhere) on CPU at rank 0, None elsewhere."""
        ...


class TorchDistBackend:
    """:class:`CompressedBackend` over a torch.distributed group, through ``collectives`` only."""

    def __init__(
        self,
        group: Optional[C.ProcessGroup] = None,
        *,
        compressor: Optional[SignCompressor] = None,
        block: int = DEFAULT_BLOCK,
        time_kernels: bool = False,
    ) -> None:
        self.group = group
        self.world_size = C.world_size(group)
        self.rank = C.rank(group)
        self.compressor = compressor or default_compressor()
        self.block = block
        self.time_kernels = time_kernels
        self.counters = CommCounters()

    def plan(self, numel: int) -> OneBitLayout:
        return OneBitLayout.plan(numel, self.world_size, self.block)

    def new_errors(self, numel: int, device: torch.device) -> ErrorFeedback:
        return ErrorFeedback.zeros(self.plan(numel), self._comm_device(device))

    def _comm_device(self, device: torch.device) -> torch.device:
        return C.device_for(self.group, device)

    @contextmanager
    def _timed(self, field: str, device: torch.device) -> Iterator[None]:
        if not self.time_kernels:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        setattr(self.counters, field, getattr(self.counters, field) + time.perf_counter() - start)

    def compressed_average_(self, tensor: Tensor, errors: ErrorFeedback) -> Tensor:
        layout = errors.layout
        if layout.numel != tensor.numel() or layout.world != self.world_size:
            raise ValueError(
                f"error buffers planned for {layout}, got {tensor.numel()} elements on {self.world_size} ranks"
            )
        if self.world_size == 1:
            return tensor
        dev = errors.worker.device
        flat = tensor.view(-1)
        with self._timed("kernel_s", dev):
            send = worker_compress(flat.to(dev, torch.float32), errors, self.compressor)
        recv = torch.empty_like(send)
        with self._timed("comm_s", dev):
            C.all_to_all(recv.view(-1), send.view(-1), self.group)
        with self._timed("kernel_s", dev):
            mine, decoded = server_reduce(recv, errors, self.compressor)
        gathered = torch.empty(self.world_size, layout.payload_bytes, dtype=torch.uint8, device=dev)
        with self._timed("comm_s", dev):
            C.all_gather(gathered.view(-1), mine, self.group)
        with self._timed("kernel_s", dev):
            if flat.device == dev and flat.dtype == torch.float32:
                decompress_gathered(gathered, layout, self.compressor, flat, self.rank, decoded)
            else:
                out = torch.empty(layout.numel, dtype=torch.float32, device=dev)
                flat.copy_(decompress_gathered(gathered, layout, self.compressor, out, self.rank, decoded))
        c = self.counters
        c.calls += 1
        c.bytes_handed += send.numel() + mine.numel()
        c.bytes_sent += wire_bytes("all_to_all", send.numel(), self.world_size)
        c.bytes_sent += wire_bytes("all_gather", mine.numel(), self.world_size)
        c.reference_bytes += allreduce_bytes(layout.numel, self.world_size)
        return tensor

    def gather_to_root(self, tensor: Tensor) -> Optional[list[Tensor]]:
        """Point-to-point, one rank at a time, so rank 0 never holds more than one extra copy on device."""
        if self.world_size == 1:
            return [tensor.detach().cpu().clone()]
        t = tensor.detach().contiguous().to(self._comm_device(tensor.device))
        if self.rank != 0:
            C.send(t, 0, self.group)
            return None
        out = [t.cpu().clone()]
        buf = torch.empty_like(t)
        for r in range(1, self.world_size):
            C.recv(buf, r, self.group)
            out.append(buf.cpu().clone())
        return out
