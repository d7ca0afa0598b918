"""What a sharded save refuses, and how a failed one is told: one line, the earlier checkpoint intact.

[Note: a failed save leaves what was there]
A save writes into a hidden partial directory that becomes the checkpoint only by its final rename
(atomic.py [Note: atomic checkpoint directories]). When the writing fails (a full disk, a read-only or
over-quota file system, any other I/O error on any rank), the saver removes its own partial directory
at once (a full disk stays full otherwise) and raises :class:`CheckpointSaveError` on every rank, one
line naming the checkpoint, the file system, the bytes the checkpoint needed and those free when the
save began, the underlying error, and the earlier checkpoint that was kept. DCP reports the ranks'
failures as one ``CheckpointException`` holding every rank's traceback; the I/O error in it is what
the user needs. Lightning's ``ModelCheckpoint`` deletes the checkpoint a new one replaces only after
``save_checkpoint`` returns, so an error raised here also keeps the top-k's earlier best.

A checkpoint of non-finite weights or optimizer states (a NaN step under ``nonfinite='ignore'``) is
refused before anything is written (:class:`NonFiniteCheckpointError`, on every rank alike): it
would replace the last good checkpoint with one that cannot resume.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint.pieces import FlatPiece


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; its partial directory was removed, earlier ones were kept."""


class NonFiniteCheckpointError(ValueError):
    """A checkpoint was refused: a weight or optimizer state holds NaN or inf."""


def first_nonfinite(entries: dict[str, Any]) -> Optional[str]:
    """The key of the first floating-point entry holding NaN or inf, or None. One max-abs reduction per
    entry on its device and one host read per device (saves are rare; this is a read pass)."""
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for key, value in entries.items():
        t = value.source if isinstance(value, FlatPiece) else value
        if torch.is_tensor(t) and t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append((key, torch.linalg.vector_norm(t.detach(), ord=math.inf)))
    bad: list[str] = []
    for pairs in by_device.values():
        finite = torch.isfinite(torch.stack([n.float() for _, n in pairs])).cpu()
        bad += [key for (key, _), ok in zip(pairs, finite.tolist()) if not ok]
    order = {k: i for i, k in enumerate(entries)}
    return min(bad, key=order.__getitem__) if bad else None


def tensors_of(obj: Any, prefix: str = "") -> dict[str, Tensor]:
    """The tensors of a nested dict/list (a full checkpoint), by dotted key."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, Tensor] = {}
    for k, v in items:
        out.update(tensors_of(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def refuse_nonfinite(findings: list[Any], final: Path, kept: Optional[Path]) -> None:
    """Raise on every rank when any rank's ``first_nonfinite`` found something (``findings``: every
    rank's, gathered)."""
    for rank, key in enumerate(findings):
        if key is not None:
            raise NonFiniteCheckpointError(
                f"Checkpoint {final} not written: '{key}' holds NaN or inf (rank {rank}); {_kept(kept)}. The run "
                "produced non-finite weights or optimizer states: ZeroStrategy(nonfinite='skip') skips such steps."
            )


def free_bytes(path: Path) -> Optional[int]:
    """Bytes free to this user on the file system of ``path`` (its nearest existing ancestor)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def filesystem_of(path: Path) -> str:
    """``<mount point> (<type>)`` of the file system holding ``path``, from /proc/mounts (Linux)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return f"{best} ({kind})" if best else "an unknown file system"


def previous_checkpoint(final: Path, last_saved: Optional[Path]) -> Optional[Path]:
    """The complete checkpoint a failed save leaves as the newest: the one at ``final`` itself (an
    overwrite), else this saver's last, else the newest complete one next to ``final``."""
    if atomic.is_sharded_checkpoint(final) or final.is_file():
        return final
    if last_saved is not None and (atomic.is_sharded_checkpoint(last_saved) or last_saved.is_file()):
        return last_saved
    try:
        siblings = [p for p in final.parent.iterdir() if not p.name.startswith(atomic.PARTIAL_PREFIX)
                    and (atomic.is_sharded_checkpoint(p) or (p.is_file() and p.suffix == ".ckpt"))]
    except OSError:
        return None
    return max(siblings, key=lambda p: p.stat().st_mtime, default=None)


def os_error_in(e: BaseException) -> Optional[OSError]:
    """The first OSError in ``e`` (a DCP CheckpointException: any rank's failure) or its causes."""
    stack: list[BaseException] = [e]
    seen: set[int] = set()
    while stack:
        x = stack.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and not isinstance(x, CheckpointSaveError):
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                exc = value[0] if isinstance(value, tuple) else value
                if isinstance(exc, BaseException):
                    stack.append(exc)
        stack += [c for c in (x.__cause__, x.__context__) if c is not None]
    return None


def save_failed(final: Path, cause: BaseException, needed: int, free: Optional[int],
                kept: Optional[Path]) -> CheckpointSaveError:
    """The one-line error of a failed save (see the module note)."""
    os_err = os_error_in(cause)
    if os_err is not None:
        name = errno.errorcode.get(os_err.errno or 0, "")
        reason = f"{os_err.strerror or os_err}{f' ({name})' if name else ''}"
        code = os_err.errno or errno.EIO
    else:
        reason, code = _one_line(cause), errno.EIO
    free_text = f"{_size(free)} were free" if free is not None else "free space unknown"
    return CheckpointSaveError(
        code,
        f"Checkpoint {final} could not be written: {reason}, on file system {filesystem_of(final.parent)}; the "
        f"checkpoint needs {_size(needed)} and {free_text} when the save began. The partial directory was "
        f"removed; {_kept(kept)}.",
    )


def _kept(kept: Optional[Path]) -> str:
    return f"the previous checkpoint {kept} is kept" if kept is not None else "no earlier checkpoint exists there"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} bytes"
