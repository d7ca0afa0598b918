"""Files of a sharded checkpoint: DCP's file layout, written without staging and verified on read.

[Note: checksummed items]
The layout is torch.distributed.checkpoint's own (``__<rank>_<i>.distcp`` files, each item a
``torch.save`` record at an offset, and a pickled ``.metadata``), so torch's tools read it too. Two
things differ from ``FileSystemWriter``/``FileSystemReader``:

1. Writing: each item is written straight from where it lives. DCP's writer keeps every tensor of a
   file alive until the file is done and copies every view (a ZeRO partition's piece of a parameter
   is a view): a rank's whole partition, twice over. Here a piece in host memory is written through
   an alias of exactly its bytes (no copy), one on the device through one host copy at a time, so a
   save needs no more memory than its largest piece (at most one bucket: a piece never crosses a
   bucket, zero/partition.py).
2. Every item's CRC-32 is computed while it is written and stored beside its offset in
   ``.metadata``; a read checks the length and the CRC before unpickling, so a truncated or corrupted
   file is an error that names the file and the entry, not a garbled tensor or an unpickling crash.
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Optional, cast

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
    """Where an item lives (DCP's record) plus the CRC-32 of its bytes."""

    crc32: Optional[int] = None


class _CrcStream(io.RawIOBase):
    """A write-only stream that forwards to ``raw`` and keeps the CRC-32 of what went through."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self.raw = raw
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)  # releases the GIL on large buffers
        self.raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()


def exact_storage(t: Tensor) -> Tensor:
    """``t`` (contiguous, in host memory) as a tensor whose storage is exactly its bytes, without a
    copy: ``torch.save`` writes a tensor's whole storage, so a view of a partition would otherwise
    drag the whole partition along (DCP clones such views instead)."""
    if t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0:
        return t
    if t.numel() == 0:
        return t.clone()
    flat = t.reshape(-1).view(torch.uint8)
    alias = torch.from_numpy(flat.numpy())  # numpy's view of the bytes: a storage of exactly nbytes
    return alias.view(t.dtype).view(t.shape)


def _to_host(t: Tensor) -> Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return exact_storage(t)


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
        with open(path, "wb") as f:
            for item in items:
                offset = f.tell()
                stream = _CrcStream(f)
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(cast(io.BytesIO, data).getbuffer())
                else:
                    torch.save(_to_host(cast(Tensor, data)), stream)
                length = f.tell() - offset
                out.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=CheckedInfo(name, offset, length, crc32=stream.crc)))
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
            for req in reqs:
                info = self.storage_data[req.storage_index]
                f.seek(info.offset)
                data = f.read(info.length)
                if len(data) != info.length:
                    raise CorruptCheckpointError(
                        f"{path} is truncated: entry '{req.storage_index.fqn}' needs bytes {info.offset}-"
                        f"{info.offset + info.length}, the file has {os.path.getsize(path)}"
                    )
                crc = getattr(info, "crc32", None)
                if crc is not None and zlib.crc32(data) != crc:
                    raise CorruptCheckpointError(
                        f"{path} is corrupted: entry '{req.storage_index.fqn}' (bytes {info.offset}-"
                        f"{info.offset + info.length}) does not match the checksum written with it"
                    )
                if req.type == LoadItemType.BYTE_IO:
                    with self._lock:
                        planner.load_bytes(req, io.BytesIO(data))
                    continue
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                tensor = _narrow(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(
                        f"{path}: entry '{req.storage_index.fqn}' has size {tuple(tensor.size())}, "
                        f"expected {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)
