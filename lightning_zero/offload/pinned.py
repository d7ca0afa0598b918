"""Host buffers for offload: pinned (page-locked) when a GPU is there, aligned for direct I/O, budgeted.

[Note: why pinned and aligned]
Copies between the GPU and pageable host memory are synchronous and go through a driver bounce
buffer (7.7 GB/s measured, DESIGN.md section 7); from pinned memory they are asynchronous DMA at
55 GB/s. Every buffer that crosses PCIe is therefore pinned. Direct I/O (``O_DIRECT``, nvme.py)
needs the buffer address, the file offset and the length to be multiples of the logical block
size, so every buffer here starts on a 4 KiB boundary and owns storage up to the next boundary:
a whole number of blocks can be read or written straight into it.

On a machine without CUDA nothing is pinned (torch cannot pin there); the buffers are still
separate host allocations, so the copy paths run in CI exactly as they do on a GPU machine.

[Note: forked workers]
A DataLoader with ``num_workers > 0`` forks the training process after the strategy has set up, and a
fork shares every page copy-on-write: each page the parent then rewrites (masters, moments, gradients,
partitions: all of them, every step) is duplicated while the workers live. On a 6.6B-parameter model
that is the difference between fitting in 128 GiB and the out-of-memory killer (measured: 1.3B with
two workers used 35 GiB of host memory for a 21 GiB RSS). Every long-lived offload buffer is
therefore its own anonymous mapping marked ``MADV_DONTFORK`` (:func:`private_pages`): children never
see it, nothing is copied. Its own mapping because the mark belongs to the pages for the mapping's
life: on malloc'ed memory it would outlive the buffer and hide reused heap pages from later children.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

ALIGN = 4096
"""Alignment (bytes) of every host buffer: a page, and a multiple of every disk's logical block."""


def round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


def private_pages(nbytes: int) -> Tensor:
    """``nbytes`` (a multiple of the page size) of zeroed host memory in a mapping of its own, which
    forked children do not inherit (see [Note: forked workers]); unmapped when the tensor is freed."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dontfork = getattr(mmap, "MADV_DONTFORK", None)  # Linux only; elsewhere children share as usual
    if dontfork is not None:
        mm.madvise(dontfork)
    return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False, align: int = ALIGN) -> Tensor:
    """A 1-D host tensor starting on an ``align``-byte boundary, with storage to the next boundary.

    ``capacity_bytes(t)`` whole blocks can be handed to ``os.preadv``/``os.pwritev`` at ``t.data_ptr()``.
    Unpinned, it is :func:`private_pages` (zeroed; not inherited by forked workers); pinned, a view into a
    slightly larger block of torch's caching pinned allocator (short-lived staging buffers).
    """
    elsize = torch.empty((), dtype=dtype).element_size()
    nbytes = round_up(max(numel * elsize, 1), align)
    if not pin and align <= mmap.PAGESIZE:
        return private_pages(round_up(nbytes, mmap.PAGESIZE)).view(dtype)[:numel]
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % align
    return raw[offset : offset + nbytes].view(dtype)[:numel]


def capacity_bytes(t: Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its storage (whole blocks for aligned_empty's)."""
    return int(t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())


def can_pin(device: torch.device, want: bool) -> bool:
    """Pin only when asked and a CUDA device is the target (torch cannot pin without an accelerator)."""
    return bool(want) and device.type == "cuda" and torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- host memory
def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def available_host_bytes() -> int:
    """Memory this process can still allocate: MemAvailable, capped by a cgroup (container) limit."""
    avail: Optional[int] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:  # not Linux: physical pages, the best portable figure
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit, usage = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is None:  # cgroup v1
        limit, usage = (_read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                        _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    if limit is not None and usage is not None and limit < (1 << 60):
        avail = min(avail, max(0, limit - usage))
    return avail


def total_host_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(need_per_rank: int, ranks_per_node: int, what: str, advice: str,
                      available: Optional[int] = None, headroom: float = 0.9) -> None:
    """Fail before allocating when the node's ranks together would need more host memory than is free.

    ``what`` itemises the buffers, ``advice`` names the setting to change; ``headroom`` leaves a
    tenth for the rest of the process (data loaders, CUDA context, Python).
    """
    free = available_host_bytes() if available is None else available
    need = need_per_rank * max(1, ranks_per_node)
    if need > headroom * free:
        gib = 2.0**30
        raise MemoryError(
            f"Offload needs {need / gib:.2f} GiB of host memory on this node ({need_per_rank / gib:.2f} GiB per rank "
            f"x {ranks_per_node} ranks: {what}), but only {free / gib:.2f} GiB are available "
            f"({headroom:.0%} usable). {advice}"
        )


def _register(ptr: int, nbytes: int) -> bool:
    """Page-lock whole pages of an existing allocation in place (cudaHostRegister); False if CUDA refuses."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    except Exception:  # no cudart binding: fall back to torch's pinned allocator
        return False
    return int(getattr(err, "value", err)) == 0


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown or no CUDA: nothing left to do
        pass


@dataclass
class HostPool:
    """Allocates (and counts) this engine's long-lived host buffers; one per engine, no global state.

    [Note: exact-size pinning]
    torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two: a 5.3 GB
    gradient buffer would pin 8 GB. Long-lived buffers are therefore allocated as ordinary memory and
    page-locked in place with ``cudaHostRegister`` (unregistered by :meth:`release`); short-lived
    staging buffers use torch's caching pinned allocator, whose rounding is harmless at their size and
    which keeps a block alive until the asynchronous copies reading it have finished.
    """

    pin: bool
    allocated: int = 0
    buffers: list[Tensor] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)

    def empty(self, numel: int, dtype: torch.dtype, pin: Optional[bool] = None) -> Tensor:
        """A long-lived buffer of its own pages (zeroed, not inherited by forked workers), page-locked
        when the pool pins and ``pin`` does not say otherwise."""
        elsize = torch.empty((), dtype=dtype).element_size()
        nbytes = round_up(max(numel * elsize, 1), max(ALIGN, mmap.PAGESIZE))
        body = private_pages(nbytes)
        if self.pin if pin is None else pin:
            if _register(body.data_ptr(), nbytes):
                self.registered.append(body.data_ptr())
            else:
                body = aligned_empty(nbytes, torch.uint8, pin=True)
        t = body.view(dtype)[:numel]
        self.allocated += capacity_bytes(t)
        self.buffers.append(t)
        return t

    def zeros(self, numel: int, dtype: torch.dtype, pin: Optional[bool] = None) -> Tensor:
        return self.empty(numel, dtype, pin).zero_()

    def release(self) -> None:
        """Unpin and drop the pool's buffers (tensors still referenced elsewhere stay alive, unpinned)."""
        for ptr in self.registered:
            _unregister(ptr)
        self.registered.clear()
        self.buffers.clear()
        self.allocated = 0
