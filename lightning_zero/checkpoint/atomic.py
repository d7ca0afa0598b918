"""A checkpoint directory appears at its final path complete, or not at all.

[Note: atomic checkpoint directories]
Every rank writes into ``<dir>/.lz-partial-<id>`` (rank 0 picks the id). When all ranks have
written (torch.distributed.checkpoint's last step gathers every rank's results before rank 0 writes
``.metadata``), rank 0 writes ``meta.pt``, fsyncs, and renames the directory to its final name; the
others wait at a barrier. A run killed before the rename leaves only a hidden ``.lz-partial-*``
directory: Lightning never picks it up (``ckpt_path="last"`` matches ``last*.ckpt``), the previous
checkpoint is untouched, and the next save into the same directory removes it. Overwriting an
existing checkpoint (``last.ckpt``) moves the old one aside first and deletes it after the rename.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Union

PARTIAL_PREFIX = ".lz-partial-"
META_FILE = "meta.pt"
DCP_METADATA = ".metadata"

PathLike = Union[str, "os.PathLike[str]"]


def is_sharded_checkpoint(path: PathLike) -> bool:
    """A complete lightning_zero sharded checkpoint (a directory with DCP's ``.metadata`` and ``meta.pt``)."""
    p = Path(path)
    return p.is_dir() and (p / DCP_METADATA).is_file() and (p / META_FILE).is_file()


def new_partial_name(final: PathLike) -> Path:
    """A fresh hidden directory next to ``final`` (same filesystem, so the rename is atomic)."""
    final = Path(final)
    return final.parent / f"{PARTIAL_PREFIX}{uuid.uuid4().hex[:12]}"


def remove_stale_partials(directory: PathLike, keep: PathLike) -> None:
    """Remove partial checkpoints left in ``directory`` by an interrupted save (rank 0 only)."""
    d, keep = Path(directory), Path(keep)
    if not d.is_dir():
        return
    for child in d.iterdir():
        if child.name.startswith(PARTIAL_PREFIX) and child != keep:
            shutil.rmtree(child, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def commit(partial: PathLike, final: PathLike, fsync: bool) -> None:
    """Rename the finished ``partial`` directory to ``final`` (rank 0 only), replacing what was there."""
    partial, final = Path(partial), Path(final)
    if fsync:
        _fsync_dir(partial)
    old = None
    if final.exists() or final.is_symlink():
        old = final.parent / f"{PARTIAL_PREFIX}old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    try:
        os.replace(partial, final)
    except BaseException:
        if old is not None:  # the previous checkpoint goes back to its name
            os.replace(old, final)
        raise
    if fsync:
        _fsync_dir(final.parent)
    if old is not None:  # the new checkpoint is in place: a leftover old one is no failure of the save
        try:
            remove(old)
        except OSError:
            shutil.rmtree(old, ignore_errors=True)


def remove(path: PathLike) -> None:
    """Delete a checkpoint, file or directory, completely."""
    p = Path(path)
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)
