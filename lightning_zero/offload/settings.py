"""What the offload engines know about the process they run in, beside their typed piece of the config.

The offload options themselves are :class:`~lightning_zero.config.offload.OffloadConfig` (the one place
their defaults are written), which the engines take as ``offload`` and read directly; this adds only the
facts about this process that the strategy passes in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadHost:
    """Where this rank runs, for the host-memory and disk checks and the swap files' names."""

    ranks_per_node: int = 1
    """Ranks sharing this host's memory and disk (the host-memory and disk checks multiply by it)."""
    global_rank: int = 0
    """Names this rank's swap files."""
    accumulate: bool = False
    """Gradient accumulation over micro-batches (the trainer's ``accumulate_grad_batches > 1``): the
    host-memory check then counts the fp32 accumulator allocated at the second micro-batch."""
