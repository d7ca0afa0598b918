"""ZeRO++ (issue #33): quantized stage-3 communication and the hierarchical weight partition.

Read by :class:`lightning_zero.zero.stage3.Stage3Engine` through lightning_zero/zero/zeropp.py, which takes
this piece (``ZeroConfig.piece(QuantCommConfig)``); ``hpz_partition_size`` also shapes the process groups
(lightning_zero/parallel_dims.py [Note: hpZ groups]). DeepSpeed's names: ``zero_quantized_weights``,
``zero_quantized_gradients``, ``zero_hpz_partition_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

VALID_WEIGHT_BITS = ("int8",)
VALID_GRADIENT_BITS = ("int8", "int4")
VALID_ROUNDING = ("nearest", "stochastic")
_OFF = (False, None, "none", "false", "off")
_ON = (True, "true", "on")


def _normalise(name: str, value: Any, valid: tuple[str, ...]) -> Union[bool, str]:
    """False (off) or one of ``valid``; True means the first of ``valid`` (DeepSpeed's boolean switch).
    Hydra hands a command-line ``int8`` of an Any field as a string and ``true`` as a bool."""
    if isinstance(value, str):
        value = value.strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return valid[0]
    if value in valid:
        return value
    raise ValueError(f"{name} must be False or one of {list(valid)} (True means {valid[0]!r}), got {value!r}.")


@dataclass
class QuantCommConfig:
    """ZeRO++'s three switches (stage 3 only; each on its own or together): qwZ, qgZ, hpZ."""

    quantized_weights: Any = False
    """qwZ: stage 3's parameter all-gathers send block-quantized ``'int8'`` codes (one fp32 scale per
    ``quant_block_size`` elements), dequantized per unit into the compute dtype; True means 'int8'. The
    partition each rank holds, the fp32 masters and the optimizer stay exact: only the gathered copy used
    in forward and backward is quantized (each element within half a quantization step of its value).
    Persistent units, ``gathered_params`` and checkpoints gather exactly. Halves the gather bytes of
    bf16 (a quarter of fp32)."""

    quantized_gradients: Any = False
    """qgZ: the gradient reduce-scatter is an all-to-all of block-quantized ``'int8'`` or ``'int4'``
    chunks, dequantized and summed in fp32 by the owner (and, with hpZ, within the node first, then
    across nodes, dequantizing and re-quantizing at each level so the error does not compound). True
    means 'int8' (DeepSpeed sends int4 across nodes: ask for it)."""

    hpz_partition_size: int = 1
    """hpZ: forward's gather keeps a secondary copy of each unit's weights (compute dtype) partitioned over
    groups of this many contiguous data-parallel ranks (a node), and backward re-gathers from it, inside
    the group only. Costs 1/hpz_partition_size of the unit weights per rank from forward to backward.
    1 (off) or the data-parallel degree mean plain stage 3; it must divide the data-parallel degree."""

    quant_block_size: int = 2048
    """qwZ/qgZ: elements per quantization block (one fp32 scale each; DeepSpeed's 2048). Smaller blocks
    follow the values more closely and send more scales (4 bytes per block)."""

    gradient_rounding: str = "nearest"
    """qgZ: how gradient codes round. ``'nearest'`` (half to even, DeepSpeed's) zeroes every element below half
    a quantization step, a bias Adam turns into weights that do not move (int4 ran 4-6% below zero3's gradient
    norm, always on the same side); ``'stochastic'`` rounds each code up or down with the probabilities that
    make it unbiased, from a hash of the element's index and a seed drawn per reduction, rank and level
    (quant/blocks.py [Note: stochastic rounding of codes]). A resumed run draws afresh. Needs
    ``quantized_gradients``. Measured (2 H200s, F's 303M GPT, benchmarks/RESULTS.md 2026-11-29 23:13): it does
    *not* bring int4 closer to zero3 (weights 5.98e-2 apart after 4 steps against 5.40e-2 rounding to nearest;
    int8: 7.6e-3) and costs 2% of tokens/s: int8 gradients are the setting that tracks zero3."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def zeropp(self) -> bool:
        """Whether any of the three switches is on (hpZ counted when > 1: its degree is checked at setup)."""
        return bool(self.quantized_weights) or bool(self.quantized_gradients) or self.hpz_partition_size > 1

    def validate(self) -> None:
        self.quantized_weights = _normalise("quantized_weights", self.quantized_weights, VALID_WEIGHT_BITS)
        self.quantized_gradients = _normalise("quantized_gradients", self.quantized_gradients, VALID_GRADIENT_BITS)
        rounding = self.gradient_rounding.strip().lower() if isinstance(self.gradient_rounding, str) else None
        if rounding not in VALID_ROUNDING:
            raise ValueError(f"gradient_rounding must be one of {list(VALID_ROUNDING)}, got {self.gradient_rounding!r}.")
        if rounding == "stochastic" and not self.quantized_gradients:
            raise ValueError("gradient_rounding='stochastic' rounds qgZ's gradient codes: it needs "
                             "quantized_gradients='int8' or 'int4'.")
        self.gradient_rounding = rounding
        h = self.hpz_partition_size
        if isinstance(h, bool) or not (isinstance(h, int) and h >= 1):
            raise ValueError(f"hpz_partition_size must be an integer >= 1 (1: off), got {h!r}.")
        b = self.quant_block_size
        if isinstance(b, bool) or not (isinstance(b, int) and b >= 2 and b % 2 == 0):
            raise ValueError(f"quant_block_size must be an even integer >= 2, got {b!r}.")
