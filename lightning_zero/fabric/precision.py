"""ZeroFabricPrecision: ZeroPrecision as Fabric calls it.

Fabric casts the module (``precision.convert_module``) inside ``fabric.setup`` *before* the strategy
sees it; a 16-bit cast then would leave the fp32 masters only bf16-accurate. So this plugin's
``convert_module`` does nothing and the strategy casts once the engines hold their fp32 masters
(apply.py ``finish_setup``, as under the Trainer). Outputs leave the module in fp32, as Fabric's
own half-precision plugins return them, so a loss computed outside the module is fp32 too.
Loss scaling and clipping are driven by the strategy (fabric/strategy.py), not by Fabric's
``pre_backward``/``clip_gradients`` paths of the base class.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_zero.precision import ZeroPrecision


class ZeroFabricPrecision(ZeroPrecision):
    """``32-true``, ``bf16-mixed`` or ``16-mixed`` (fp16 weights, dynamic loss scaling) under Fabric."""

    @override
    def convert_module(self, module: Module) -> Module:
        return module  # cast later, by the strategy (see the module docstring)

    @override
    def convert_output(self, data: Any) -> Any:
        if not self.is_mixed and self.autocast_dtype is None:  # autocast: fp32 out, as Fabric's MixedPrecision
            return data
        dtype = torch.get_default_dtype()
        return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)
