"""ZeroPrecision: 16-bit weights for compute, fp32 master weights in the optimizer partition.

Unlike Lightning's ``MixedPrecision`` (autocast over fp32 weights: 4+4+8 bytes per parameter and a
cast on every matmul), the mixed modes here follow DeepSpeed's layout: the module itself is cast
to 16-bit, the fp32 master copy exists once, partitioned, inside the ZeRO engine (2+2+12 bytes per
parameter). ``16-mixed`` means fp16 weights with dynamic loss scaling, said plainly (Lightning
#18016: "16-mixed" there means autocast, which surprises DeepSpeed users).

The strategy replaces whatever precision plugin Lightning's connector built from ``precision=...``
with one of these (see ``ZeroStrategy.precision_plugin``).

[Note: two mixed-precision layouts]
``mixed_precision='cast'`` (the default, config/mixed.py) is the layout above. ``'autocast'`` is Lightning
ddp's: the engines run exactly as under ``32-true`` (fp32 weights, gradients, reductions and masters; the
module and its buffers are not cast, inputs are not converted) and the step contexts Lightning enters
around ``training_step`` and the evaluation steps (``forward_context``) are ``torch.autocast`` in the 16-bit
dtype. ddp's ``bf16-mixed`` is the same autocast over the same fp32 weights, so the two train alike to fp32
rounding, where the cast layout differs by design (16-bit BatchNorm statistics and rotary ``inv_freq``,
16-bit gradient reductions). ``16-mixed`` keeps its dynamic loss scaling (fp16 activations still underflow);
the engines unscale as under the cast layout. ``compute_dtype`` is what the engines lay out (fp32 here);
``autocast_dtype`` is what the forward computes in.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.config import LossScaleConfig
from lightning_zero.parallel.dtensor import grad_like, local_tensor, point_local
from lightning_zero.zero.loss_scaler import DynamicLossScaler

VALID_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ZeroPrecision(Precision):
    """Precision of a ZeroStrategy run: ``32-true``, ``bf16-mixed`` or ``16-mixed``."""

    def __init__(
        self, precision: Union[str, int] = "32-true", loss_scale: Optional[Union[LossScaleConfig, dict]] = None
    ) -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in VALID_PRECISIONS:
            raise ValueError(
                f"ZeroStrategy supports precision {list(VALID_PRECISIONS)}, got {precision!r}. "
                "('bf16-true'/'16-true' would drop the fp32 master weights: use the '-mixed' modes, whose "
                "16-bit weights already cost 2 bytes per parameter.)"
            )
        self.precision = precision  # type: ignore[assignment]
        self.compute_dtype: torch.dtype = _DTYPES[precision]
        self.autocast_dtype: Optional[torch.dtype] = None
        """Under ``mixed_precision='autocast'``: the dtype of ``torch.autocast`` around the steps ([Note: two
        mixed-precision layouts]); None: no autocast (the cast layout, or ``32-true``)."""
        self.device_type = "cuda"
        """The device type autocast runs on (the strategy sets its root device's)."""
        if isinstance(loss_scale, dict):
            loss_scale = LossScaleConfig(**loss_scale)
        self.scaler: Optional[DynamicLossScaler] = (
            DynamicLossScaler(loss_scale or LossScaleConfig()) if precision == "16-mixed" else None
        )
        self._clip: Optional[tuple[float, GradClipAlgorithmType]] = None

    @classmethod
    def from_plugin(cls, plugin: Precision) -> "ZeroPrecision":
        """Convert what Lightning's connector built from ``Trainer(precision=...)``."""
        if isinstance(plugin, ZeroPrecision):
            return plugin
        name = str(getattr(plugin, "precision", "32-true"))
        if type(plugin).__name__ in ("Precision", "MixedPrecision") and _ALIASES.get(name, name) in VALID_PRECISIONS:
            return cls(name)
        raise ValueError(
            f"ZeroStrategy cannot use precision plugin {type(plugin).__name__} (precision={name!r}); "
            f"pass Trainer(precision=...) with one of {list(VALID_PRECISIONS)}."
        )

    def use_autocast(self, on: bool) -> "ZeroPrecision":
        """Switch between the two layouts of [Note: two mixed-precision layouts] (no effect under ``32-true``);
        returns ``self``. Called by the strategies from their config before the engines exist."""
        dtype = _DTYPES[str(self.precision)]
        mixed = dtype != torch.float32
        self.autocast_dtype = dtype if on and mixed else None
        self.compute_dtype = torch.float32 if on else dtype
        return self

    @property
    def is_mixed(self) -> bool:
        """Whether the module computes in 16-bit weights (the cast layout); False under autocast."""
        return self.compute_dtype != torch.float32

    @override
    def forward_context(self) -> AbstractContextManager:
        """``torch.autocast`` under ``mixed_precision='autocast'``; nothing otherwise (the weights are the dtype)."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=False)  # as Lightning's

    def cast_module(self, module: Module) -> Module:
        """The module in the compute dtype (the strategy calls it once the engines hold fp32 masters).

        With DTensor parameters (tensor parallelism) not through ``module.to``: ``nn.Module._apply`` swaps
        every DTensor parameter and its gradient for converted copies, which cuts the engines' gradient
        views out of the flat buffers (``.grad`` then stops accumulating there and those weights never
        step). Engine-managed DTensors are in the compute dtype already; others are cast by local shard
        (parallel/dtensor.py [Note: a DTensor's dtype is its own]), plain tensors as ``module.to`` does."""
        if not self.is_mixed:
            return module
        dtype = self.compute_dtype
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            return module.to(dtype)
        for m in module.modules():
            for p in m._parameters.values():
                if p is None or not p.is_floating_point() or p.dtype == dtype:
                    continue
                if isinstance(p, DTensor):
                    point_local(p, local_tensor(p).detach().to(dtype))
                else:
                    p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = grad_like(p, local_tensor(p.grad).to(dtype))
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    m._buffers[name] = b.to(dtype)
        return module

    @override
    def convert_module(self, module: Module) -> Module:
        return self.cast_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        if not self.is_mixed:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Record the request: the engine clips after unscaling, by the true global norm over all partitions, or
        by value ([Note: clipping by value]).

        [Note: clipping by value]
        ``gradient_clip_algorithm="value"`` clamps each element of the all-reduced, unscaled gradient to
        [-v, v]. Elementwise, so clamping each rank's reduced shard (zero/engine.py ``step``, after the
        non-finite check) is ddp's clamp exactly; ``grad_norm`` stays the norm before clipping. Partial
        offload's device share (``offload_ratio`` < 1) is refused (offload/engine.py).
        """
        if clip_val and clip_val > 0:
            self._clip = (float(clip_val), GradClipAlgorithmType(gradient_clip_algorithm))

    def pop_clip(self) -> tuple[Optional[float], Optional[float]]:
        """This step's clipping request as ``(max_norm, max_value)`` (at most one set), then forgotten."""
        clip, self._clip = self._clip, None
        if clip is None:
            return None, None
        return (clip[0], None) if clip[1] == GradClipAlgorithmType.NORM else (None, clip[0])

    @property
    def loss_scale(self) -> Optional[float]:
        return self.scaler.scale if self.scaler is not None else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how messages name a dtype."""
    return str(dtype).replace("torch.", "")


_MISMATCH = re.compile(r"same dtype|should be the same|expected scalar type|same type|to have the same")
_HALF_NAMES = re.compile(r"bfloat16|BFloat16|Half|float16")


def explain_cast_layout_mismatch(error: BaseException, precision: "ZeroPrecision") -> Optional[str]:
    """The hint torch's dtype-mismatch error needs under the cast layout (None for any other error or layout).

    Under ``bf16-mixed`` Lightning's ddp runs the forward under ``torch.autocast``, which reconciles a tensor the
    user cast to fp32 (``self.head(h.float())``) with the layer's weights; the cast layout trains the module
    itself in 16 bits, so the same line fails with torch's "mat1 and mat2 must have the same dtype", which names
    nothing of ours ([Note: two mixed-precision layouts]). The hint names the layout and ddp's."""
    dtype = precision.compute_dtype
    if not isinstance(error, RuntimeError) or dtype == torch.float32:
        return None
    text = str(error)
    if not _MISMATCH.search(text) or not _HALF_NAMES.search(text):
        return None
    name = dtype_name(dtype)
    return (f"{text}\n\nlightning_zero: under precision='{precision.precision}' the ZeRO strategy trains the module "
            f"itself in {name} (DeepSpeed's layout, mixed_precision='cast'), where Lightning's ddp keeps fp32 weights "
            f"under torch.autocast: a tensor your code casts to fp32 (`x.float()`) meets {name} weights here. Pass "
            "ZeroStrategy(mixed_precision='autocast') (Hydra: strategy.mixed_precision=autocast) for ddp's layout, or "
            "keep the activations in the module's dtype.")
