"""FP8 linears (issue #33 item 1): which ``nn.Linear``s compute in float8, and with which scaling recipe.

Read by lightning_zero/lowp/fp8.py, which swaps the chosen Linears for torchao's ``Float8Linear`` before the
engines exist (apply.py [Note: the order of apply_zero], step 0). What fp8 cannot be combined with in another
concern is checked in ``ZeroConfig.validate``; what depends on the machine (the GPU, torchao, the precision,
the Linears' shapes) is checked at setup, where it is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

VALID_RECIPES = ("tensorwise", "rowwise")
_OFF = (None, False, "none", "false", "off", "")


@dataclass
class Fp8Config:
    """FP8 training of the model's Linears with dynamic scaling (torchao's float8 recipes)."""

    fp8: Optional[str] = None
    """None (off), ``'tensorwise'`` (one scale per tensor: the fastest, torchtitan's default) or
    ``'rowwise'`` (one scale per row: more accurate with outliers, a little slower). Forward matmuls take
    e4m3 inputs and weights; backward's gradients are e5m2 (tensorwise) or e4m3 (rowwise). Needs
    ``precision='bf16-mixed'`` and a GPU with fp8 (compute capability >= 8.9: Ada, Hopper, Blackwell),
    or ``fp8_emulate=True``. The weights, the fp32 masters and the checkpoints stay as without fp8."""

    fp8_filter: Any = None
    """Linears kept in bf16, by name: a list of substrings of the module's fully qualified name
    (``['lm_head', 'router']``, torchtitan's ``filter_fqns``), or one string. Added to the first and last
    Linear (``fp8_keep_first_last``). Every other Linear must have both dims divisible by 16 (fp8 GEMMs'
    requirement): name the ones that do not here."""

    fp8_keep_first_last: bool = True
    """Keep the model's first and last ``nn.Linear`` (in module order) in bf16: the input projection and the
    output head are the most sensitive to fp8's 3-bit mantissa and cost little (torchtitan keeps its output
    layer in bf16)."""

    fp8_emulate: bool = False
    """Quantize to float8 and back exactly as on a GPU, but multiply in higher precision (torchao's
    ``emulate``): the numerics of fp8 training on CPU or a GPU without fp8, for tests; no speedup."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        recipe = self.fp8.strip().lower() if isinstance(self.fp8, str) else self.fp8
        if recipe in _OFF:
            self.fp8 = None
        elif recipe in VALID_RECIPES:
            self.fp8 = recipe
        else:
            raise ValueError(f"fp8 must be None or one of {list(VALID_RECIPES)}, got {self.fp8!r}.")
        f = self.fp8_filter
        if f is None:
            f = ()
        elif isinstance(f, str):
            f = (f,)
        if not all(isinstance(s, str) and s for s in f):
            raise ValueError(f"fp8_filter must be a list of non-empty module-name substrings, got {self.fp8_filter!r}.")
        self.fp8_filter = list(f) or None
        for name in ("fp8_keep_first_last", "fp8_emulate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
