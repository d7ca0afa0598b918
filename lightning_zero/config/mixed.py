"""How the ``-mixed`` precisions run: the module cast to 16 bits (DeepSpeed's layout) or autocast over fp32
weights (Lightning ddp's). Read by lightning_zero/precision.py ([Note: two mixed-precision layouts]).
"""

from __future__ import annotations

from dataclasses import dataclass

VALID_MIXED = ("cast", "autocast")


@dataclass
class MixedPrecisionConfig:
    """The layout of ``precision='bf16-mixed'`` and ``'16-mixed'`` (no effect under ``'32-true'``)."""

    mixed_precision: str = "cast"
    """'cast' (DeepSpeed's layout, the default): the module's weights and floating buffers are cast to 16 bits,
    the fp32 masters live once, partitioned, in the engines; gradients are reduced and stage 3 gathers in 16
    bits (2+2+12 bytes per parameter). 'autocast' (Lightning ddp's ``bf16-mixed``): weights, gradients and
    buffers stay fp32 and the forward runs under ``torch.autocast``, so a run trains as ddp's to fp32 rounding
    (BatchNorm statistics and HF's rotary ``inv_freq`` stay fp32); costs fp32 gradient reductions, stage 3's
    gathers in fp32 and 4+4+8 bytes per parameter. Neither fp8 nor 16-bit states (which compute from bf16
    weights) combine with 'autocast'."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def autocast(self) -> bool:
        return self.mixed_precision == "autocast"

    def validate(self) -> None:
        if self.mixed_precision not in VALID_MIXED:
            raise ValueError(f"mixed_precision must be one of {list(VALID_MIXED)}, got {self.mixed_precision!r}.")
