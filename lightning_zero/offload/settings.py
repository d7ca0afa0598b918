"""What the offload engines read from ZeroConfig, plus where this rank runs.

The fields are read through from :class:`~lightning_zero.config.strategy.ZeroConfig` (the one place
their defaults are written), under the same names; nothing here has a default of its own except the
facts about this process that the strategy passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from lightning_zero.config.strategy import ZeroConfig


@dataclass(frozen=True)
class OffloadSettings:
    """ZeroConfig's offload fields for one engine (see the module docstring)."""

    config: ZeroConfig
    ranks_per_node: int = 1
    """Ranks sharing this host's memory and disk (the host-memory and disk checks multiply by it)."""
    global_rank: int = 0
    """Names this rank's swap files."""
    accumulate: bool = False
    """Gradient accumulation over micro-batches (the trainer's ``accumulate_grad_batches > 1``): the
    host-memory check then counts the fp32 accumulator allocated at the second micro-batch."""

    @property
    def offload_optimizer(self) -> str:
        return self.config.offload_optimizer

    @property
    def offload_params(self) -> str:
        return self.config.offload_params

    @property
    def nvme_path(self) -> Optional[str]:
        return self.config.nvme_path

    @property
    def pin_memory(self) -> bool:
        return self.config.pin_memory

    @property
    def nvme_chunk_numel(self) -> int:
        """fp32 elements per NVMe swap chunk (``nvme_chunk_mb``)."""
        return max(1, int(self.config.nvme_chunk_mb * 2**20) // 4)

    @property
    def nvme_io_threads(self) -> int:
        return self.config.nvme_io_threads

    @property
    def nvme_fraction(self) -> float:
        return self.config.nvme_fraction

    @property
    def delayed_param_update(self) -> bool:
        return self.config.delayed_param_update

    @property
    def delayed_param_update_warmup(self) -> int:
        return self.config.delayed_param_update_warmup

    @property
    def offload_step_in_backward(self) -> bool:
        return self.config.offload_step_in_backward

    @property
    def offload_ratio(self) -> Union[float, str]:
        return self.config.offload_ratio

    @property
    def offload_state_precision(self) -> str:
        return self.config.offload_state_precision

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_params)
