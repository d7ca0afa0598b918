"""How Lightning's checkpoints are written (lightning_zero/checkpoint/strategy_io.py reads these)."""

from __future__ import annotations

from dataclasses import dataclass


VALID_CHECKPOINT_FORMATS = ("sharded", "full")


@dataclass
class CheckpointConfig:
    """Checkpoint format and the sharded writer's threads, fsync and asynchrony."""

    checkpoint_format: str = "sharded"
    """How Lightning's checkpoints are written. 'sharded': a directory at the checkpoint's path, written
    through torch.distributed.checkpoint by every rank, each writing only the partitions it owns (no
    gather; resumable under any stage and world size; ``python -m lightning_zero.checkpoint consolidate``
    makes one plain file of it). 'full': one ordinary file with the full fp32 weights and optimizer
    state, gathered onto every rank first (needs the whole model to fit; readable by plain torch).
    Loading accepts either, whatever this says."""

    checkpoint_async: bool = False
    """Sharded checkpoints: copy this rank's partitions into host memory and write them in a background
    thread while training goes on (torch.distributed.checkpoint's async save, over a separate gloo
    group). The next save, the end of fit and an exception wait for it; costs one host copy of the
    rank's partitions."""

    checkpoint_threads: int = 4
    """Sharded checkpoints: files (and writer threads) per rank; reads use as many threads."""

    checkpoint_fsync: bool = True
    """Sharded checkpoints: fsync every file before the directory is renamed into place, so a finished
    checkpoint also survives a machine crash (a killed process never leaves a half-written one either way)."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.checkpoint_format not in VALID_CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format must be one of {list(VALID_CHECKPOINT_FORMATS)}, got {self.checkpoint_format!r}."
            )
        if not (isinstance(self.checkpoint_threads, int) and self.checkpoint_threads >= 1):
            raise ValueError(f"checkpoint_threads must be an integer >= 1, got {self.checkpoint_threads!r}.")
        if self.checkpoint_async and self.checkpoint_format != "sharded":
            raise ValueError("checkpoint_async=True needs checkpoint_format='sharded'.")
