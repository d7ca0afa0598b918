"""NVMe swap files: a checked scratch directory, and asynchronous, aligned, direct, checksummed I/O.

[Note: swap directory]
Swap files live in ``<nvme_path>/lightning_zero_swap/<host>-pid<P>-rank<R>-<id>/`` with an ``OWNER`` file
(host, pid) and the root holds a README that says what they are. A directory whose owner process
is gone (a crash, a kill -9) is removed when the next run on that host starts; one whose owner is
alive (a concurrent run) is left alone. Files end in ``.swap`` and hold raw tensor bytes, nothing a
checkpoint loader would pick up. The directory is removed when its owner closes it (teardown).

[Note: direct I/O in a thread pool]
Each file is cut into segments (64 MiB) read or written by ``os.preadv``/``os.pwritev`` in a pool of
threads (they release the GIL, as does ``zlib.crc32``), with ``O_DIRECT`` so that GBs of optimizer
state do not evict everything else from the page cache and bandwidth is the disk's. Direct I/O
needs block-aligned addresses and lengths: buffers come from pinned.aligned_empty, the last block
is written whole and the file is then truncated to the exact byte count, so a swap file holds
exactly the tensor's bytes. Filesystems without ``O_DIRECT`` (tmpfs, some overlays) fall back to
buffered I/O, said once in the log.

[Note: checksums]
Every segment's CRC-32 is recorded when it is written and checked when it is read back, together
with the file's size. A swap file that was modified, truncated or deleted between steps raises
:class:`SwapFileError` naming the file: training never continues on corrupt state.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import socket
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_zero.offload.pinned import ALIGN, aligned_empty, capacity_bytes, round_up

log = logging.getLogger(__name__)

ROOT_NAME = "lightning_zero_swap"
OWNER = "OWNER"
SUFFIX = ".swap"
SEGMENT = 64 << 20
README = (
    "Scratch swap files of lightning_zero's NVMe offload (optimizer states and parameter partitions of\n"
    "running trainings). They are NOT checkpoints and cannot be loaded as such. A run removes its own\n"
    "directory at teardown; directories of runs that died are removed by the next run on this host.\n"
)


class SwapFileError(RuntimeError):
    """A swap file is missing, truncated or corrupt: its contents cannot be trusted."""


class NvmePathError(ValueError):
    """``nvme_path`` cannot hold the swap files (missing, not a directory, read-only, too small)."""


# ---------------------------------------------------------------------------------------- the directory
def free_disk_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale(root: Path) -> list[Path]:
    """Remove swap directories under ``root`` whose owner process on this host is gone."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    host = socket.gethostname()
    for d in root.iterdir():
        marker = d / OWNER
        if not d.is_dir() or not marker.is_file():
            continue  # not ours: never touched
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host") == host and not _pid_alive(int(owner.get("pid", -1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _probe_direct(directory: Path) -> bool:
    """Write, sync, read back and delete one block; True when O_DIRECT works there. Raises OSError
    when the directory is not writable."""
    probe = directory / f".probe-{uuid.uuid4().hex[:8]}"
    buf = aligned_empty(ALIGN, torch.uint8).fill_(7)
    direct = hasattr(os, "O_DIRECT")
    try:
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
        except OSError as err:
            if not direct or err.errno != errno.EINVAL:
                raise
            direct = False
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                os.pwritev(fd, [_view(buf, ALIGN)], 0)
            except OSError as err:
                if not direct or err.errno != errno.EINVAL:
                    raise
                direct = False
                os.pwritev(fd, [_view(buf, ALIGN)], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return direct


def check_nvme_dir(nvme_path: str) -> Path:
    """What can be checked before the model's size is known (ZeroConfig's validation, so at the
    strategy's construction, before any process starts): the directory exists, is a directory, takes a
    file, and its disk is not full. ``check_nvme_path`` checks the free space against the swap files'
    size at setup."""
    path = _existing_dir(nvme_path)
    probe = path / f".lz-probe-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise NvmePathError(
            f"nvme_path '{nvme_path}' is not writable ({err.strerror or err}); offload to 'nvme' writes swap files there. "
            "Choose a writable directory with free space."
        ) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return path


def _existing_dir(nvme_path: str) -> Path:
    """``nvme_path`` as a Path, or one clear error: it does not exist, or is not a directory."""
    path = Path(nvme_path).expanduser()
    if not path.exists():
        raise NvmePathError(
            f"nvme_path '{nvme_path}' does not exist. Create it (on a fast local disk) or set nvme_path to one that does."
        )
    if not path.is_dir():
        raise NvmePathError(f"nvme_path '{nvme_path}' is not a directory.")
    return path


def check_nvme_path(nvme_path: Optional[str], need_bytes: int, what: str) -> Path:
    """One clear error before training when ``nvme_path`` cannot take ``need_bytes`` of swap files."""
    if not nvme_path:
        raise NvmePathError("offload to 'nvme' needs nvme_path (a directory on a fast local disk).")
    path = _existing_dir(nvme_path)
    root = path / ROOT_NAME
    try:
        root.mkdir(exist_ok=True)
        _probe_direct(root)
    except OSError as err:
        raise NvmePathError(
            f"nvme_path '{nvme_path}' is not writable ({err.strerror or err}); offload to 'nvme' writes swap files there. "
            "Choose a writable directory."
        ) from None
    removed = clean_stale(root)
    if removed:
        log.warning("lightning_zero: removed %d stale swap director%s of dead runs under %s",
                    len(removed), "y" if len(removed) == 1 else "ies", root)
    free = free_disk_bytes(str(path))
    if free < need_bytes:
        gib = 2.0**30
        raise NvmePathError(
            f"nvme_path '{nvme_path}' has {free / gib:.2f} GiB free, but the swap files need {need_bytes / gib:.2f} GiB "
            f"({what}). Free space there, choose a larger disk, or use more ranks/nodes (each holds 1/N)."
        )
    return path


@dataclass
class SwapDir:
    """This rank's swap directory (see [Note: swap directory])."""

    nvme_path: Path
    rank: int
    path: Path = field(init=False)
    direct: bool = field(init=False)

    def __post_init__(self) -> None:
        root = self.nvme_path / ROOT_NAME
        root.mkdir(exist_ok=True)
        readme = root / "README.txt"
        if not readme.exists():
            readme.write_text(README)
        host = socket.gethostname()
        self.path = root / f"{host}-pid{os.getpid()}-rank{self.rank}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        (self.path / OWNER).write_text(json.dumps({"host": host, "pid": os.getpid(), "rank": self.rank}))
        self.direct = _probe_direct(self.path)
        if not self.direct:
            log.warning("lightning_zero: %s does not support O_DIRECT; NVMe offload uses buffered I/O there.", self.path)

    def file(self, name: str) -> Path:
        return self.path / f"{name}{SUFFIX}"

    def remove(self) -> None:
        """Swap files first, the OWNER marker last: a removal cut short (the process killed) leaves a
        directory that :func:`clean_stale` still recognises as a dead run's and removes at the next start."""
        if self.path.is_dir():
            for child in self.path.iterdir():
                if child.name != OWNER:
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------------------------------- the I/O
def _view(t: Tensor, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``t.data_ptr()`` (the caller keeps ``t`` alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def _segments(nbytes: int) -> list[tuple[int, int]]:
    return [(off, min(SEGMENT, nbytes - off)) for off in range(0, max(nbytes, 1), SEGMENT)] if nbytes else []


def _join(futures: list[Future], path: Path, what: str) -> list[int]:
    """Every segment's result, once all of them have finished (the caller closes the shared file
    descriptor next: closing it while a sibling thread still uses it means EBADF, or I/O into whatever
    file reuses the number). The first failure is raised naming the file."""
    wait(futures)
    for f in futures:
        err = f.exception()
        if isinstance(err, SwapFileError):
            raise err
        if err is not None:
            raise SwapFileError(
                f"NVMe swap {what} of {path} failed: {err}. Training stopped (the swapped state cannot be trusted); "
                "free the disk or fix it, then resume from the last checkpoint."
            ) from err
    return [f.result() for f in futures]


@dataclass
class SwapRecord:
    nbytes: int
    crcs: list[int]


class SwapOp:
    """One file's pending read or write; ``wait()`` completes it (and raises its errors)."""

    def __init__(self, finish: Callable[[], object]) -> None:
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._done = True
            self._finish()


class NvmeSwapper:
    """Reads and writes named swap files of one SwapDir through a thread pool, checking every byte."""

    def __init__(self, swap_dir: SwapDir, threads: int) -> None:
        self.dir = swap_dir
        self.records: dict[str, SwapRecord] = {}
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lz-nvme")
        self.bytes_written = 0
        self.bytes_read = 0

    def _flags(self) -> int:
        return os.O_DIRECT if self.dir.direct and hasattr(os, "O_DIRECT") else 0

    def write(self, name: str, src: Tensor) -> SwapOp:
        """Start writing ``src`` (an aligned_empty buffer, or a view at its start) to ``name``."""
        nbytes = src.numel() * src.element_size()
        if src.data_ptr() % ALIGN or capacity_bytes(src) < round_up(nbytes):
            raise ValueError("NvmeSwapper.write needs a buffer from pinned.aligned_empty")
        path = self.dir.file(name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        except OSError as err:
            raise SwapFileError(f"cannot create NVMe swap file {path}: {err}") from err
        segs = _segments(nbytes)

        def seg_write(off: int, length: int) -> int:
            view = _view(src, round_up(nbytes))[off : off + round_up(length)]  # whole blocks (the tail too)
            crc = zlib.crc32(view[:length])
            done = 0
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], off + done)
            return crc

        futures: list[Future] = [self.pool.submit(seg_write, o, n) for o, n in segs]

        def finish() -> None:
            try:
                crcs = _join(futures, path, "write")
                os.ftruncate(fd, nbytes)
            except OSError as err:
                raise SwapFileError(f"NVMe swap write of {path} failed: {err}") from err
            finally:
                os.close(fd)
            self.records[name] = SwapRecord(nbytes, crcs)
            self.bytes_written += nbytes

        return SwapOp(finish)

    def read(self, name: str, dst: Tensor) -> SwapOp:
        """Start reading ``name`` into ``dst`` (an aligned_empty buffer); ``wait()`` verifies it."""
        record = self.records.get(name)
        if record is None:
            raise KeyError(f"no swap file '{name}' was written by this run")
        nbytes = record.nbytes
        if dst.numel() * dst.element_size() != nbytes or dst.data_ptr() % ALIGN or capacity_bytes(dst) < round_up(nbytes):
            raise ValueError(f"NvmeSwapper.read: buffer does not fit swap file '{name}' ({nbytes} bytes)")
        path = self.dir.file(name)
        try:
            fd = os.open(path, os.O_RDONLY | self._flags())
        except FileNotFoundError:
            raise SwapFileError(
                f"NVMe swap file {path} is missing: it was deleted while training ran. Its state is lost; "
                "resume from the last checkpoint."
            ) from None
        size = os.fstat(fd).st_size
        if size != nbytes:
            os.close(fd)
            raise SwapFileError(
                f"NVMe swap file {path} holds {size} bytes, expected {nbytes}: it was truncated or overwritten. "
                "Resume from the last checkpoint."
            )
        segs = _segments(nbytes)

        def seg_read(off: int, length: int) -> int:
            view = _view(dst, round_up(nbytes))[off : off + round_up(length)]
            got = 0
            while got < length:
                n = os.preadv(fd, [view[got:]], off + got)
                if n == 0:
                    break
                got += n
            if got < length:
                raise SwapFileError(f"NVMe swap file {path} ended early (read {off + got} of {nbytes} bytes).")
            return zlib.crc32(view[:length])

        futures = [self.pool.submit(seg_read, o, n) for o, n in segs]

        def finish() -> None:
            try:
                crcs = _join(futures, path, "read")
            finally:
                os.close(fd)
            for i, (got, want) in enumerate(zip(crcs, record.crcs)):
                if got != want:
                    lo = i * SEGMENT
                    raise SwapFileError(
                        f"NVMe swap file {path} is corrupt: checksum mismatch in bytes [{lo}, {min(lo + SEGMENT, nbytes)}) "
                        "(modified on disk, or a disk error). Training stopped rather than use it; resume from "
                        "the last checkpoint."
                    )
            self.bytes_read += nbytes

        return SwapOp(finish)

    def has(self, name: str) -> bool:
        return name in self.records

    def close(self, remove: bool = True) -> None:
        self.pool.shutdown(wait=True)
        if remove:
            self.dir.remove()
        self.records.clear()
