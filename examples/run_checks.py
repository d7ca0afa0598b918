"""What ``examples/train.py`` checks before anything starts: the overrides, the composed config's keys,
the checkpoint to resume from and the host's room for the model. Each refusal is one line.

Why before Hydra for the overrides: Hydra answers a misspelt key with five lines that end in a hint to
add ``+`` (``+seeed=1``), which it then accepts into the config, where nothing reads it: the run trains
with the default and exits 0. Here an override's top-level key must be a field of the root schema or a
config group, and after composition every key of a typed node must be a field of its dataclass, so
``+anything=1`` and ``+trainer.anything=1`` are refused too (the ``callbacks`` dict is open by design).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

GIB = 2.0**30
FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                    "--config-dir", "-cd", "--info", "-i", "--experimental-rerun")
"""Hydra's command-line flags that take the next argument as their value."""


class ConfigRefused(ValueError):
    """A configuration the example will not run; its message is the one line printed."""


def check_overrides(argv: Sequence[str], root: type, conf_dir: Path) -> None:
    """Refuse an override whose top-level key is neither a field of ``root`` nor a config group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    known = {f.name for f in dataclasses.fields(root)} | groups | {"hydra"}
    args = list(argv)
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in FLAGS_WITH_VALUE:
            i += 2
            continue
        if not arg.startswith("-") and "=" in arg or arg.startswith("~"):
            overrides.append(arg)
        i += 1
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # noqa: BLE001 - a syntax error is Hydra's to report, with its own message
            continue
        top = override.key_or_group.split("@")[0].split("/")[0].split(".")[0]  # hydra/launcher=..., +x@pkg=...
        if top not in known:
            close = difflib.get_close_matches(top, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigRefused(
                f"unknown config key {top!r} in {text!r}{hint}: the keys are {', '.join(sorted(known - {'hydra'}))}."
            )


def unknown_keys(cfg: DictConfig, path: str = "") -> list[str]:
    """Keys of typed nodes that their dataclass does not declare (added with ``+``), by full path."""
    out: list[str] = []
    typ = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(typ):
        fields = {f.name for f in dataclasses.fields(typ)}
        out += [f"{path}{k}" for k in cfg.keys() if k not in fields]
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            out += unknown_keys(node, f"{path}{key}.")
    return out


def check_keys(cfg: DictConfig) -> None:
    extra = unknown_keys(cfg)
    if extra:
        raise ConfigRefused(f"unknown config key(s) {', '.join(extra)}: no schema field has that name (see --cfg job).")


def resolve_ckpt_path(value: Optional[str], run_dir: str) -> Optional[str]:
    """``ckpt_path`` as a path Lightning reads (see ``RunConfig.ckpt_path``); None trains from scratch.

    ``last`` searches this run's directory, then the run directories beside it and one level up (the
    ``runs/<date>/<time>`` layout), and takes the newest ``checkpoints/last.ckpt`` whose checkpoint exists.
    """
    if value is None:
        return None
    run = Path(run_dir)
    if value == "last":
        dirs = [run, *sorted(run.parent.glob("*")), *sorted(run.parent.parent.glob("*/*"))]
        found = [d / "checkpoints" / "last.ckpt" for d in dirs if (d / "checkpoints" / "last.ckpt").exists()]
        if not found:
            raise ConfigRefused(
                f"ckpt_path=last: no checkpoints/last.ckpt in {run} or the run directories beside it; "
                "give the checkpoint's path (ckpt_path=runs/<date>/<time>/checkpoints/last.ckpt)."
            )
        return str(max(found, key=lambda p: p.resolve().stat().st_mtime).resolve())
    path = Path(value)
    if (path / "checkpoints" / "last.ckpt").exists():  # a run directory
        path = path / "checkpoints" / "last.ckpt"
    if not path.exists():
        raise ConfigRefused(f"ckpt_path={value}: {path} does not exist.")
    return str(path.resolve())


def host_available_bytes() -> Optional[float]:
    """MemAvailable of /proc/meminfo (Linux); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_room(need_bytes: float, what: str, hint: str) -> None:
    """Refuse a run whose model state cannot fit this host's available memory (it would be OOM-killed
    while building, with no message)."""
    available = host_available_bytes()
    if available is not None and need_bytes > available:
        raise ConfigRefused(
            f"{what} needs about {need_bytes / GIB:.1f} GiB of host memory and this host has "
            f"{available / GIB:.1f} GiB available: {hint}"
        )


def discard_if_empty(run_dir: str) -> None:
    """Remove a refused run's directory when it holds nothing but Hydra's ``.hydra/`` and log files (the
    refusal is printed; a run directory without a run in it would only be clutter among the real ones)."""
    run = Path(run_dir)
    if not run.is_dir():
        return
    for entry in run.iterdir():
        if entry.name == ".hydra" or (entry.is_file() and entry.suffix == ".log"):
            continue
        return
    shutil.rmtree(run, ignore_errors=True)
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", run.parent.name):  # runs/<date>/ too, when this run was its only one
        try:
            run.parent.rmdir()
        except OSError:
            pass


__all__ = [
    "ConfigRefused", "check_overrides", "unknown_keys", "check_keys", "resolve_ckpt_path", "check_host_room",
    "host_available_bytes", "discard_if_empty",
]
