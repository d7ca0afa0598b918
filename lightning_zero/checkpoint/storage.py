"""Files of a sharded checkpoint: DCP's file layout, written without staging and verified on read.

[Note: checksummed items]
The layout is torch.distributed.checkpoint's (``__<rank>_<i>.distcp`` files, items at offsets, a
pickled ``.metadata`` planned by DCP, which does the resharding). Three things differ from
``FileSystemWriter``/``FileSystemReader``:

1. Each item is written from where it lives. DCP's writer keeps every tensor of a file alive until
   the file is done and copies every view (a ZeRO partition's piece of a parameter is a view): a
   rank's whole partition, twice over. Here a piece in host memory is written without a copy, one on
   the device through one pinned host copy at a time, so a save needs no more memory than its
   largest piece (at most one bucket: a piece never crosses a bucket, zero/partition.py).
2. Tensors are written as their raw bytes, dtype and shape recorded in ``.metadata``, not as
   ``torch.save`` records (``torch.save`` into a stream ran at a fraction of the disk's speed).
   torch's own ``FileSystemReader`` therefore cannot read these files; ``python -m
   lightning_zero.checkpoint consolidate`` makes an ordinary checkpoint of them.
3. Every item's CRC-32 is computed over its bytes as they are written and stored beside its offset;
   a read checks the length and the CRC first, so a truncated or corrupted file is an error that
   names the file and the entry, not a garbled tensor.
"""

from __future__ import annotations

import ctypes
import io
import itertools
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
from torch import Tensor
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _split_by_size_and_type
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult


def _narrow(t: Tensor, offsets: Any, lengths: Any) -> Tensor:
    """The sub-block of ``t`` that a read item asks for."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != t.size(dim):
            t = t.narrow(dim, offset, length)
    return t


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, shorter than recorded, or does not match its checksum."""


@dataclass
class CheckedInfo(_StorageInfo):
    """Where an item lives (DCP's record), the CRC-32 of its bytes, and for a tensor written raw its
    dtype and shape (pickled into ``.metadata``)."""

    crc32: Optional[int] = None
    dtype: Optional[str] = None
    shape: Optional[tuple[int, ...]] = None


def _bytes_of(t: Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (any dtype). Not through ``.numpy()``:
    that marks the storage non-resizable for good, and stage 3 and NVMe offload release storages by
    resizing them to 0. The caller keeps ``t`` alive while the view is used."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in a checkpoint's .metadata")
    return dtype


class _Staging:
    """One writer thread's pinned host buffer for device pieces (grown to the largest piece, reused):
    pinned copies run at full PCIe speed, and a save holds one piece per thread in host memory.
    Host pieces are written from where they are."""

    def __init__(self) -> None:
        self.buffer: Optional[Tensor] = None

    def to_host(self, t: Tensor) -> Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return t if t.is_contiguous() else t.contiguous()
        n = t.numel() * t.element_size()
        if self.buffer is None or self.buffer.numel() < n:
            self.buffer = None
            self.buffer = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        dst = self.buffer[:n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        return dst


class CheckedWriter(FileSystemWriter):
    """DCP's file writer with in-place item writes and per-item CRC-32 (see the Note above).
    ``on_item(nbytes)`` is called after each item (progress)."""

    def __init__(self, path: str, thread_count: int = 4, sync_files: bool = True, on_item: Optional[Any] = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=thread_count,
                         overwrite=True)
        self.on_item = on_item

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        bins = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        jobs = [(f"{prefix}{i}.distcp", items) for i, items in enumerate(bins)]
        results: list[WriteResult] = []
        if len(jobs) <= 1:
            for name, items in jobs:
                results += self._write_file(name, items, planner)
        else:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="lz-ckpt-write") as pool:
                for part in pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs):
                    results += part
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        out = []
        path = os.path.join(self.path, name)
        staging = _Staging()
        with open(path, "wb") as f:
            for item in items:
                offset = f.tell()
                data = planner.resolve_data(item)
                dtype = shape = None
                if item.type == WriteItemType.BYTE_IO:
                    view = cast(io.BytesIO, data).getbuffer()
                else:  # raw bytes: the dtype and shape go to .metadata (no torch.save framing, no copy)
                    host = staging.to_host(cast(Tensor, data))
                    view, dtype, shape = _bytes_of(host), str(host.dtype), tuple(host.shape)
                crc = zlib.crc32(view)  # releases the GIL on large buffers, as the write does
                f.write(view)
                length = f.tell() - offset
                out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=CheckedInfo(
                    name, offset, length, crc32=crc, dtype=dtype, shape=shape)))
                if self.on_item is not None:
                    self.on_item(length)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        return out


class CheckedReader(FileSystemReader):
    """DCP's file reader that checks every item's length and CRC-32 first (see the Note above), with
    files read by ``thread_count`` threads."""

    def __init__(self, path: str, thread_count: int = 4) -> None:
        super().__init__(path)
        self.thread_count = thread_count
        self._lock = threading.Lock()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return super().read_metadata(*args, **kwargs)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{self.path}: no '.metadata' file (not a complete sharded checkpoint)") from e
        except Exception as e:  # unpickling a damaged file raises anything
            raise CorruptCheckpointError(f"{os.path.join(self.path, '.metadata')} is damaged: {e}") from e

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(req)
        jobs = sorted(per_file.items())
        if len(jobs) <= 1 or self.thread_count <= 1:
            for name, reqs in jobs:
                self._read_file(name, reqs, planner)
        else:
            with ThreadPoolExecutor(min(self.thread_count, len(jobs)), thread_name_prefix="lz-ckpt-read") as pool:
                list(pool.map(lambda job: self._read_file(job[0], job[1], planner), jobs))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, name: str, reqs: list[Any], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            raise CorruptCheckpointError(f"{path} is missing (the checkpoint's .metadata lists it)")
        reqs = sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset)
        with open(path, "rb") as f:
            for _, same in itertools.groupby(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                self._read_item(path, f, list(same), planner)

    def _read_item(self, path: str, f: Any, reqs: list[Any], planner: LoadPlanner) -> None:
        """Read and check one stored item once, then answer every request on it (a load asking for
        several boxes of one writer's chunk, pieces.py, does not read it once per box)."""
        info = self.storage_data[reqs[0].storage_index]
        where = f"entry '{reqs[0].storage_index.fqn}' (bytes {info.offset}-{info.offset + info.length})"
        buf = torch.empty(info.length, dtype=torch.uint8)
        f.seek(info.offset)
        got = f.readinto(memoryview(buf.numpy())) if info.length else 0
        if got != info.length:
            raise CorruptCheckpointError(f"{path} is truncated: {where} is past its end ({os.path.getsize(path)} bytes)")
        crc = getattr(info, "crc32", None)
        if crc is not None and zlib.crc32(memoryview(buf.numpy())) != crc:
            raise CorruptCheckpointError(f"{path} is corrupted: {where} does not match the checksum written with it")
        stored: Optional[Tensor] = None
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                with self._lock:
                    planner.load_bytes(req, io.BytesIO(buf.numpy().tobytes()))
                continue
            if stored is None:
                dtype = getattr(info, "dtype", None)
                if dtype is not None:  # written raw by CheckedWriter
                    stored = buf.view(_dtype(dtype)).view(info.shape)
                else:  # DCP's own torch.save records
                    stored = torch.load(io.BytesIO(buf.numpy().tobytes()), map_location="cpu", weights_only=True)
            tensor = _narrow(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CorruptCheckpointError(f"{path}: {where} has size {tuple(tensor.size())}, expected {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
