"""16-bit optimizer states on the device (issue #33 item 3): the precision of the partitioned master and
Adam moments that the ZeRO engines keep on the device, without offload.

The engines (lightning_zero/zero/states16.py) take this piece (``ZeroConfig.piece(StatePrecisionConfig)``)
as ``states``; what it cannot combine with (stage 0, optimizer offload, which has its own
``offload_state_precision``) is checked in ``ZeroConfig.validate``, and what only the engine sees (the
optimizer's class, the compute dtype) when the engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass

VALID_DEVICE_STATE_PRECISIONS = ("fp32", "bf16_sr", "bf16_kahan")


@dataclass
class StatePrecisionConfig:
    """The layout of the device optimizer partition (stages 1-3 without offload)."""

    state_precision: str = "fp32"
    """Stages 1-3 without offload: the layout of this rank's master weights and Adam moments on the device
    (lightning_zero/zero/states16.py [Note: 16-bit states on the device]). 'fp32' (12 bytes per parameter:
    fp32 master, exp_avg, exp_avg_sq; torch's Adam exactly), 'bf16_sr' (6: bf16 master and moments,
    stochastically rounded), 'bf16_kahan' (8: bf16 master with a bf16 Kahan compensation word, bf16
    moments). The bf16 master is also the compute weight (stage 3 gathers it directly: no separate 16-bit
    partition). The math is the compact host states' (optim/reference_lowp.py): a slightly different
    algorithm from fp32 Adam (the example GPT trains to within 1% of it). Adam/AdamW with bf16-mixed
    only; with optimizer offload use ``offload_state_precision``. Checkpoints hold the states
    as they are (bf16) and load into runs of any state precision."""

    grad_shard_precision: str = "fp32"
    """With 16-bit ``state_precision``: the dtype of each rank's reduced-gradient shard (the reduce-scatter's
    output, accumulated over micro-batches until the step). 'fp32' (4 bytes per parameter of the partition)
    or 'bf16' (2): the gradients are reduced in bf16 either way, so on two or more ranks without gradient
    accumulation the values are the same; with accumulation each micro-batch's sum is rounded to bf16.
    Under stage 3 on one GPU it takes the persistent bytes per parameter from 10 to 8 (``bf16_sr``)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def compact(self) -> bool:
        """Whether the engines keep 16-bit states (anything but 'fp32')."""
        return self.state_precision != "fp32"

    def validate(self) -> None:
        if self.state_precision not in VALID_DEVICE_STATE_PRECISIONS:
            raise ValueError(f"state_precision must be one of {list(VALID_DEVICE_STATE_PRECISIONS)}, got "
                             f"{self.state_precision!r}.")
        if self.grad_shard_precision not in ("fp32", "bf16"):
            raise ValueError(f"grad_shard_precision must be 'fp32' or 'bf16', got {self.grad_shard_precision!r}.")
        if self.grad_shard_precision != "fp32" and not self.compact:
            raise ValueError("grad_shard_precision='bf16' needs state_precision='bf16_sr' or 'bf16_kahan' (fp32 Adam "
                             "states step from fp32 gradients).")
