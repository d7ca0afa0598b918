"""``MyModule.load_from_checkpoint(DIR)`` on a sharded checkpoint directory.

[Note: load_from_checkpoint on a directory]
Lightning's ``load_from_checkpoint`` opens its argument as one file (``pl_load`` in
``lightning.pytorch.core.saving``), which fails on any sharded directory. Users call it by habit, so
``import lightning_zero`` wraps that one function (once; idempotent): a lightning_zero sharded
directory is consolidated on the fly in host memory (consolidate.py), anything else goes to
Lightning's own loader unchanged. This is the package's only patch of another library; it touches
no other path (``Trainer.fit(ckpt_path=...)`` goes through the strategy's ``load_checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from lightning_zero.checkpoint.atomic import is_sharded_checkpoint

_MARK = "_lightning_zero_sharded_aware"


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if isinstance(path_or_url, (str, Path)) and is_sharded_checkpoint(path_or_url):
            from lightning_zero.checkpoint.consolidate import load_consolidated

            return load_consolidated(path_or_url, weights_only=True)  # host tensors; Lightning moves the model
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    setattr(pl_load, _MARK, True)
    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    return pl_load


def install() -> None:
    """Make Lightning's ``load_from_checkpoint`` read lightning_zero sharded directories."""
    import lightning.pytorch.core.saving as saving

    if not getattr(saving.pl_load, _MARK, False):
        saving.pl_load = _wrap(saving.pl_load)
