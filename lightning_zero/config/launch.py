"""How the processes and their process groups are started (environment.py's init_process_groups reads these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


VALID_START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass
class LaunchConfig:
    """Process-group backend and timeout, and how Lightning starts extra local processes."""

    process_group_backend: Optional[str] = None
    """torch.distributed backend; None picks nccl on CUDA and gloo on CPU."""

    timeout_s: float = 1800.0
    """Collective timeout of the process groups, in seconds."""

    start_method: str = "popen"
    """How Lightning starts extra local processes: 'popen' re-runs the script (like ddp), 'spawn'/'fork'
    use multiprocessing. Ignored under torchrun/SLURM, which start the processes themselves."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.process_group_backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"process_group_backend must be one of [None, 'nccl', 'gloo'], got {self.process_group_backend!r}."
            )
        if self.start_method not in VALID_START_METHODS:
            raise ValueError(
                f"start_method must be one of {list(VALID_START_METHODS)}, got {self.start_method!r}."
            )
