"""FLOPs of the aten ops that actually run, counted at the dispatcher.

[Note: counting what runs]
A formula (6N per token) says what a model *should* cost; a profiler must say what it *did*: a
layer skipped, an attention that runs at another length, a recomputation, a head that is a plain
``F.linear`` outside every module. :class:`OpFlopCounter` is a ``TorchDispatchMode``: every aten op
of the step passes through it (forward, backward on autograd's threads, recomputation), and ops with
a FLOP formula are counted from their argument shapes with torch's own formulas
(``torch.utils.flop_counter``'s registry: mm/addmm/bmm/baddbmm, convolutions, the fused attention
kernels, each with its backward). Torch's registry lacks the CPU flash-attention kernel that
``F.scaled_dot_product_attention`` uses on CPU; it is added with torch's SDPA formula, so a CPU run
counts attention as a GPU run does. Only multiply-accumulate ops have formulas, each counting a
multiply-add as 2 FLOPs, so MACs = FLOPs / 2. Elementwise ops, norms and softmax count 0, as in
torch's FlopCounterMode and the PaLM/MFU convention; a bias add inside ``addmm`` counts 0 too.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper


@shape_wrapper
def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@shape_wrapper
def _cpu_sdpa_backward_flop(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                            out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _registry() -> dict[Any, Callable[..., int]]:
    table = dict(flop_registry)
    aten = torch.ops.aten
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flop),
    ):
        packet = getattr(aten, name, None)
        if packet is not None and packet not in table:
            table[packet] = formula
    return table


FLOP_REGISTRY: dict[Any, Callable[..., int]] = _registry()
"""aten op overload packet -> FLOPs from (args, kwargs, out_val); torch's registry plus the CPU SDPA kernels."""


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op call (0 for ops without a formula)."""
    formula = FLOP_REGISTRY.get(getattr(func, "_overloadpacket", func))
    if formula is None:
        return 0
    return int(formula(*args, **(kwargs or {}), out_val=out))


class OpFlopCounter(TorchDispatchMode):
    """Calls ``sink(flops, func)`` for every counted op while active ([Note: counting what runs])."""

    def __init__(self, sink: Callable[[int, Any], None]) -> None:
        super().__init__()
        self.sink = sink
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = op_flops(func, args, kwargs, out)
        if flops:
            self.total += flops
            self.sink(flops, func)
        return out


__all__ = ["FLOP_REGISTRY", "op_flops", "OpFlopCounter"]
