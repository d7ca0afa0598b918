"""ZeRO-Offload and ZeRO-Infinity settings: where the optimizer states and parameters live off the device.

The offload engines (lightning_zero/offload/engine.py over host_optimizer.py and its step policy) take this piece
(``ZeroConfig.piece(OffloadConfig)``) as ``offload`` and read it under these names; what the strategy
knows about the process (ranks per node, global rank, accumulation) comes beside it as
:class:`lightning_zero.offload.settings.OffloadHost`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

VALID_OFFLOAD = ("none", "cpu", "nvme")
VALID_STATE_PRECISIONS = ("fp32", "bf16_sr", "bf16_kahan", "int8")


@dataclass
class OffloadConfig:
    """Optimizer and parameter offload (the ZeRO stage's part is checked by ZeroConfig, which sees both)."""

    offload_optimizer: str = "none"
    """ZeRO-Offload (stages 1-3): where the fp32 master weights and optimizer states live. 'none' (the
    device), 'cpu' (pinned host memory; the step runs on the CPU, with the compiled CPU Adam for
    Adam/AdamW) or 'nvme' (files under ``nvme_path``, swapped through host buffers chunk by chunk).
    Costs PCIe traffic (gradients down, 16-bit parameters up) and CPU time; saves 12-14 bytes per
    parameter of device memory. ``python -m lightning_zero.estimate`` shows the trade for a model."""

    offload_params: str = "none"
    """ZeRO-Infinity (stage 3 only, with ``offload_optimizer``): where the 16-bit parameter partitions
    live between uses: 'none' (the device), 'cpu' (pinned host memory) or 'nvme' (one file per unit
    and rank). They are copied to the device unit by unit, with the same prefetch as the gathers."""

    nvme_path: Optional[str] = None
    """Directory for 'nvme' offload (a fast local disk; not tmpfs, which is RAM); no default (the
    ``zero3_offload_nvme`` preset refuses without one). It must exist and be writable (checked here,
    when the config is built, before any process starts) and have room for the swap files (checked at
    setup, once the model's size is known). Swap files go to a
    ``lightning_zero_swap`` subdirectory and are removed at teardown; never point it at checkpoints."""

    pin_memory: bool = True
    """Offload: page-lock the host buffers, so device<->host copies are asynchronous and ~7x faster.
    Pinned memory cannot be swapped by the OS; turn off when the host is short of RAM."""

    nvme_chunk_mb: float = 256.0
    """'nvme' optimizer offload: MiB of fp32 master per swap chunk. Three chunks' buffers (master and
    optimizer states) are in host memory at once: one being read, one stepped, one written."""

    nvme_io_threads: int = 4
    """'nvme' offload: threads doing the direct (O_DIRECT) reads and writes and their checksums."""

    nvme_fraction: float = 1.0
    """'nvme' optimizer offload: the fraction of the masters and optimizer states (whole chunks) kept on
    NVMe; the rest stays in host memory and is stepped without I/O. Below 1 when the disk is smaller
    than the states, or to trade host memory for less disk traffic."""

    offload_ratio: Any = 1.0
    """Optimizer offload: the fraction of this rank's optimizer partition (fp32 masters and Adam moments)
    kept in host memory and stepped by the CPU; the rest stays on the device and is stepped there by a
    fused Adam, after backward (DeepSpeed's partial offload "ratio"). 1.0: everything on the host (plain
    ZeRO-Offload); 0.0: nothing (offload_optimizer then only changes where checkpoints stage). A float in
    [0, 1], or 'auto': the first step runs fully offloaded, then the largest device-resident share that
    fits the device's free memory (measured peak of that step, 10% headroom) moves to the device. The
    host share is the partition's *first* buckets (the last layers: their gradients land first, so the
    CPU step overlaps the rest of backward longest). Adam/AdamW only; not with delayed_param_update.
    See lightning_zero/offload/device_share.py."""

    offload_state_precision: str = "fp32"
    """CPU optimizer offload: the layout of the host masters and Adam moments (issue #15;
    lightning_zero/optim/host_states.py [Note: host state precisions]). 'fp32' (12 bytes per parameter,
    torch's Adam exactly), 'bf16_sr' (6: bf16 master and moments, stochastic rounding), 'bf16_kahan'
    (8: bf16 master with a bf16 Kahan compensation word, bf16 moments), 'int8' (~6: fp32 master, 8-bit
    blockwise moments). The compact layouts halve the host memory of the optimizer (what decides the
    largest model a host can train), not the step time, and change the algorithm slightly (all train the
    example GPT to within 1% of fp32 Adam in 300 steps). Checkpoints hold torch's fp32 layout either way.
    Adam/AdamW, offload_optimizer='cpu' and offload_ratio=1 only."""

    delayed_param_update: bool = False
    """Offload: the ZeRO-Offload paper's one-step delayed parameter update. The CPU step of step t runs
    while the device computes step t+1, which therefore uses parameters one update old. Hides the CPU
    step almost entirely; the price is staleness: the paper reports unchanged convergence after a few
    dozen synchronous warm-up steps, but it is a change of the algorithm (results differ from the
    synchronous run and from ddp; validation sees parameters one step old). Off by default."""

    delayed_param_update_warmup: int = 10
    """With ``delayed_param_update``: synchronous steps before the delay starts (early training moves
    fastest, where staleness hurts most)."""

    offload_step_in_backward: bool = True
    """'cpu' optimizer offload: run the CPU Adam step range by range while backward still runs, as each
    bucket's reduced gradient lands in host memory. Same results as stepping after backward; used only
    for steps that need no global view of the gradients first (no clipping, no fp16 loss scaling, no
    gradient accumulation, ``nonfinite='ignore'``, Adam/AdamW; see lightning_zero/offload/eager.py),
    otherwise the step runs after backward as usual. False: always after backward."""


    def __post_init__(self) -> None:
        self.validate()

    @property
    def offloads(self) -> bool:
        """Whether any state leaves the device (selects the offloading engines)."""
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_params)

    @property
    def nvme_chunk_numel(self) -> int:
        """fp32 elements per NVMe swap chunk (``nvme_chunk_mb``)."""
        return max(1, int(self.nvme_chunk_mb * 2**20) // 4)

    def validate(self) -> None:
        """Offload settings that cannot work together fail here, at construction, and so does an
        ``nvme_path`` that does not exist or takes no file (its free space against the swap files' size
        is checked at setup, once the model's size is known)."""
        self.validate_choices()
        if self.offload_params != "none" and self.offload_optimizer == "none":
            raise ValueError(
                f"offload_params={self.offload_params!r} with offload_optimizer='none' would keep the 12-byte "
                "fp32 masters and optimizer states on the device while moving the 2-byte parameters off it: "
                "set offload_optimizer='cpu' (or 'nvme') too."
            )
        if self.uses_nvme:
            if not self.nvme_path:  # no default: a path that exists on every machine is not a fast local disk
                raise ValueError(
                    "offload to 'nvme' needs nvme_path: an existing directory on a fast local disk (not tmpfs), e.g. "
                    "ZeroStrategy(stage=3, offload_optimizer='nvme', offload_params='nvme', nvme_path='/mnt/nvme'), "
                    "or strategy.nvme_path=/mnt/nvme on the command line of examples/train.py."
                )
            from lightning_zero.offload.nvme import check_nvme_dir  # (keeps config free of torch at import)

            check_nvme_dir(self.nvme_path)  # exists, writable, disk not full: before any process starts
        if not self.nvme_chunk_mb > 0 or not (isinstance(self.nvme_io_threads, int) and self.nvme_io_threads >= 1):
            raise ValueError(
                f"nvme_chunk_mb must be > 0 and nvme_io_threads an integer >= 1, got {self.nvme_chunk_mb!r}, "
                f"{self.nvme_io_threads!r}."
            )
        if not 0.0 < self.nvme_fraction <= 1.0:
            raise ValueError(f"nvme_fraction must be in (0, 1], got {self.nvme_fraction!r}.")
        if self.delayed_param_update and self.offload_optimizer == "none":
            raise ValueError("delayed_param_update needs offload_optimizer='cpu' or 'nvme' (it overlaps the CPU step).")
        self._validate_offload_ratio()
        self._validate_state_precision()
        if self.delayed_param_update_warmup < 0:
            raise ValueError(f"delayed_param_update_warmup must be >= 0, got {self.delayed_param_update_warmup!r}.")

    def validate_choices(self) -> None:
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in VALID_OFFLOAD:
                raise ValueError(f"{name} must be one of {list(VALID_OFFLOAD)}, got {getattr(self, name)!r}.")

    def _validate_state_precision(self) -> None:
        valid = VALID_STATE_PRECISIONS
        if self.offload_state_precision not in valid:
            raise ValueError(f"offload_state_precision must be one of {list(valid)}, got {self.offload_state_precision!r}.")
        if self.offload_state_precision != "fp32" and (self.offload_optimizer != "cpu" or self.offload_ratio != 1.0):
            raise ValueError(
                f"offload_state_precision={self.offload_state_precision!r} needs offload_optimizer='cpu' and "
                f"offload_ratio=1 (got {self.offload_optimizer!r}, {self.offload_ratio!r}): the compact layouts live "
                "in host memory and are stepped by the CPU."
            )

    def _validate_offload_ratio(self) -> None:
        r = self.offload_ratio
        if isinstance(r, str) and r != "auto":
            try:
                r = self.offload_ratio = float(r)  # Hydra hands command-line numbers of an Any field as they came
            except ValueError:
                raise ValueError(f"offload_ratio must be a number in [0, 1] or 'auto', got {r!r}.") from None
        if r == "auto":
            pass
        elif isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= float(r) <= 1.0:
            raise ValueError(f"offload_ratio must be a number in [0, 1] or 'auto', got {r!r}.")
        else:
            self.offload_ratio = float(r)
        if r == 1.0:
            return
        if self.offload_optimizer == "none":
            raise ValueError(
                f"offload_ratio={r!r} needs offload_optimizer='cpu' or 'nvme': it splits the offloaded optimizer "
                "partition between host and device."
            )
        if self.delayed_param_update:
            raise ValueError(
                f"offload_ratio={r!r} with delayed_param_update=True: the device share would step synchronously and "
                "the host share one step late. Use one or the other."
            )
