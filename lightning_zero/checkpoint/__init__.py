"""Sharded checkpoints (issue #13): written by every rank through torch.distributed.checkpoint,
resharded on load, atomic, verified, optionally asynchronous, consolidated offline.

Where things happen: ``strategy_io.py`` (Lightning's hooks) -> ``sharded.py`` (save/load
orchestration) -> ``layout.py`` (which pieces a rank writes and reads, under which keys) ->
``pieces.py`` (the resharding protocol, tensor-parallel blocks included) -> ``storage.py`` (files,
checksums) and ``atomic.py`` (partial directory, rename); ``tp_full.py``: the full format's TP gathers. ``consolidate.py`` and ``__main__.py`` work offline;
``lightning_load.py`` lets ``load_from_checkpoint`` read a directory.
"""

from lightning_zero.checkpoint.atomic import is_sharded_checkpoint
from lightning_zero.checkpoint.consolidate import consolidate, describe, load_consolidated
from lightning_zero.checkpoint.storage import CorruptCheckpointError

__all__ = ["CorruptCheckpointError", "consolidate", "describe", "is_sharded_checkpoint", "load_consolidated"]
