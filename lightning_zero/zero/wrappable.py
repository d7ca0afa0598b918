"""Which optimizers the ZeRO engines can wrap, and the error for those they cannot.

The engines re-point every param group at one flat 1-D fp32 shard (see [Note: parameters are
views] in flat_group.py). That is exact only for optimizers whose update of an element depends on
that element alone (SGD, Adam, ...). Optimizers that look at a tensor's shape or norm (LAMB's trust
ratio, Adafactor's row/column factors, LBFGS's line search over all parameters) would silently
change their math, so they are refused before training starts.
"""

from __future__ import annotations

import torch

ELEMENTWISE_TORCH_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD", "Adagrad")
    if hasattr(torch.optim, name)
)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """True when ZeRO can partition this optimizer's state elementwise without changing its math.

    An optimizer class declares itself with a class attribute ``zero_elementwise`` (lightning_zero's
    own optimizers do); otherwise torch's elementwise optimizers are accepted by exact type.
    """
    declared = getattr(type(optimizer), "zero_elementwise", None)
    if declared is not None:
        return bool(declared)
    return type(optimizer) in ELEMENTWISE_TORCH_OPTIMIZERS


def check_wrappable(optimizer: object, stage: int) -> None:
    """Raise a clear TypeError if ZeRO ``stage`` cannot wrap ``optimizer``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ZeRO stage {stage} needs a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if not is_elementwise(optimizer):
        names = sorted(t.__name__ for t in ELEMENTWISE_TORCH_OPTIMIZERS) + ["CPUAdam", "FusedAdam"]
        raise TypeError(
            f"ZeRO stage {stage} cannot wrap {type(optimizer).__name__}: it partitions optimizer state "
            f"elementwise over flat buffers, which changes the math of optimizers that use a tensor's "
            f"shape or norm. Supported: {', '.join(names)} (or a class with `zero_elementwise = True`)."
        )
    if optimizer.state and not _untouched_initial_state(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s); "
            "ZeRO must wrap an optimizer before its first step."
        )


def _untouched_initial_state(optimizer: torch.optim.Optimizer) -> bool:
    """Adagrad fills its state in ``__init__`` (``step`` 0, ``sum`` at ``initial_accumulator_value``) and again,
    identically, at its first step when a tensor has none: that state is no step taken, and the engines drop
    it (their masters get theirs at the first step)."""
    if type(optimizer) is not getattr(torch.optim, "Adagrad", None):
        return False
    return all(float(st.get("step", 1)) == 0 for st in optimizer.state.values())
