"""MoQ (DeepSpeed's Mixture-of-Quantization) as a Lightning callback: quantization-aware training on a
precision schedule, then weights exported in the format the quantized inference path loads.

[Note: MoQ]
``MoQ(schedule={0: 16, 200: 8, 400: 4})`` makes every ``nn.Linear`` of the LightningModule compute with its
weight quantized to the scheduled precision (int8 or int4, grouped: quant.py [Note: weight-only groups])
from that global step on; 16 means unquantized (the weight in its own dtype, as DeepSpeed's 16-bit start
is within bf16's rounding). The forward uses ``dequantize(quantize(w))``, the backward passes the gradient
to ``w`` unchanged (the straight-through estimator), so the optimizer keeps stepping full-precision weights
(under ZeRO: the fp32 masters, whatever the stage) while the loss is that of the quantized network. Each
Linear's ``forward`` is replaced on the instance (names, parameters, state dict and ZeRO-3's unit hooks are
untouched) at ``on_fit_start`` and put back at ``on_fit_end``; evaluation inside ``fit`` uses the current
precision too, evaluation outside it the full weights.

After training, :func:`export_quantized` turns the Linears into :class:`~lightning_zero.inference.quant.QuantLinear`
at the final precision: their ``dequantize(codes, scales)`` is the very weight the last training steps
computed with, so the exported model's outputs equal the quantization-aware forward's; its state dict
(codes and scales as buffers) loads into any model on which :func:`~lightning_zero.inference.quant.quantize_linears`
built the same structure.
"""

from __future__ import annotations

import fnmatch
import types
from typing import Any, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_zero.inference.quant import dequantize_weight, quantize_linears, quantize_weight
from lightning_zero.parallel.dtensor import is_tp_sharded

UNQUANTIZED = 16


class _QuantizeSTE(torch.autograd.Function):
    """Forward: the grouped quantize-dequantize of ``w``; backward: the gradient unchanged (straight through)."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, bits: int, group_size: int) -> Tensor:
        return dequantize_weight(quantize_weight(w, bits, group_size), w.shape[1]).to(w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad, None, None


def fake_quantize(w: Tensor, bits: int, group_size: int) -> Tensor:
    """``w`` as the network computes with it at ``bits`` ([Note: MoQ]): itself at 16, quantized otherwise."""
    return w if bits >= UNQUANTIZED else _QuantizeSTE.apply(w, bits, group_size)


class MoQ(pl.Callback):
    """Quantization-aware training on a precision schedule ([Note: MoQ]).

    ``schedule``: global step -> bits (16, 8 or 4) from that step on; the entry for step 0 is the start
    (16 if absent). ``group_size``: input features per quantization group. ``skip``: fnmatch patterns of
    Linear module names (relative to the LightningModule) left unquantized, e.g. ``["model.lm_head"]``.
    ``export_path``: at the end of ``fit``, rank 0 saves the LightningModule's state dict there with every
    quantized Linear's weight as its codes and scales at the final precision (:func:`quantized_state_dict`),
    loadable into the module once ``quantize_linears`` has prepared it (collective under ZeroStrategy)."""

    def __init__(self, schedule: Mapping[int, int], group_size: int = 128, skip: Sequence[str] = (),
                 export_path: Optional[str] = None) -> None:
        steps = sorted((int(s), int(b)) for s, b in schedule.items())
        bad = [b for _, b in steps if b not in (4, 8, UNQUANTIZED)]
        if not steps or bad or steps[0][0] < 0:
            raise ValueError(f"MoQ schedule must map steps >= 0 to bits in (16, 8, 4), got {dict(schedule)}")
        if steps[0][0] > 0:
            steps.insert(0, (0, UNQUANTIZED))
        self.schedule = steps
        self.group_size = group_size
        self.skip = list(skip)
        self.export_path = export_path
        self.bits = steps[0][1]
        """The precision the Linears compute with now."""
        self._patched: list[nn.Linear] = []

    def bits_at(self, step: int) -> int:
        return [b for s, b in self.schedule if s <= step][-1]

    @property
    def final_bits(self) -> int:
        return self.schedule[-1][1]

    def _forward(self, layer: nn.Linear, x: Tensor) -> Tensor:
        return F.linear(x, fake_quantize(layer.weight, self.bits, self.group_size), layer.bias)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callback = self
        targets = [(name, m) for name, m in pl_module.named_modules()
                   if type(m) is nn.Linear and not any(fnmatch.fnmatchcase(name, p) for p in self.skip)]
        for name, module in targets:
            if is_tp_sharded(module.weight):
                raise ValueError(f"MoQ: '{name}' is split by tensor parallelism; quantizing TP shards is not built "
                                 "yet (skip it with MoQ(skip=[...]) or train with tensor_parallel=1)")
        for _, module in targets:
            module.forward = types.MethodType(lambda layer, x: callback._forward(layer, x), module)  # type: ignore[method-assign]
            self._patched.append(module)
        self.bits = self.bits_at(trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.bits = self.bits_at(trainer.global_step)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for module in self._patched:
            if "forward" in module.__dict__:
                del module.forward
        self._patched = []
        if self.export_path is not None:
            full = getattr(trainer.strategy, "full_state_dict", None)  # ZeroStrategy: gathered (collective)
            state = full() if callable(full) else pl_module.state_dict()
            if trainer.is_global_zero:
                torch.save(quantized_state_dict(pl_module, state, self.final_bits, self.group_size, self.skip),
                           self.export_path)
            trainer.strategy.barrier("moq_export")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "group_size": self.group_size}

    def export(self, model: nn.Module, skip: Optional[Sequence[str]] = None) -> list[str]:
        """:func:`export_quantized` at this schedule's final precision (``skip`` relative to ``model``)."""
        return export_quantized(model, self.final_bits, self.group_size, self.skip if skip is None else skip)


def export_quantized(model: nn.Module, bits: int, group_size: int, skip: Sequence[str] = ()) -> list[str]:
    """Replace the Linears of ``model`` (full weights: a plain model, or one loaded from a consolidated
    checkpoint) by QuantLinears at ``bits`` ([Note: MoQ]); at 16 bits nothing changes. Returns the names."""
    if bits >= UNQUANTIZED:
        return []
    return quantize_linears(model, bits=bits, group_size=group_size, skip=skip)


def quantized_state_dict(module: nn.Module, state: Mapping[str, Tensor], bits: int, group_size: int,
                         skip: Sequence[str] = ()) -> dict[str, Tensor]:
    """``state`` (``module``'s full state dict) with each ``nn.Linear``'s ``weight`` replaced by the ``codes`` and
    ``scales`` :class:`~lightning_zero.inference.quant.QuantLinear` holds, quantized from the weight in the
    Linear's own dtype (the values the quantized forward computed with). At 16 bits: ``state`` unchanged."""
    out = dict(state)
    if bits >= UNQUANTIZED:
        return out
    for name, m in module.named_modules():
        if type(m) is not nn.Linear or any(fnmatch.fnmatchcase(name, p) for p in skip):
            continue
        qb = quantize_weight(out.pop(f"{name}.weight").to(m.weight.dtype), bits, group_size)
        out[f"{name}.codes"], out[f"{name}.scales"] = qb.codes, qb.scales
    return out
