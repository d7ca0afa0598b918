"""Weight-only int8 / int4 quantization of ``nn.Linear`` weights for inference (grouped, symmetric).

[Note: weight-only groups]
Each output row of a Linear weight ``[out, in]`` is cut into groups of ``group_size`` input features; a
group keeps one fp32 scale ``max|w| / q_max`` and its codes ``round(w / scale)`` (int8: q_max 127;
int4: q_max 7, two codes per byte). That is quant/blocks.py's block format applied to the weight with
every row zero-padded to a multiple of the group size, so blocks never straddle two rows: the codes and
scales are ``blocks.quantize``'s, bit for bit, and every dequantized weight is within half its group's
step of the original. Activations stay in the compute dtype (weight-only), which is what bounds decode:
at batch 1 a matmul reads each weight once, so int8 reads ~0.26x and int4 ~0.13x of fp32's bytes per
weight (group 128: codes plus one fp32 scale per group; ~0.52x and ~0.27x of bf16's).

[Note: the kernel seam]
:func:`weight_only_linear` is the one place a quantized Linear computes. Its path here (CPU, and any
device where no kernel applies) dequantizes the whole weight to the input's dtype and calls ``F.linear``:
correct everywhere, no faster than the unquantized layer. Fused kernels plug in through
:func:`register_kernel` and must match this path (the dequantize-then-matmul reference) to within the
matmul's rounding. Three are built in, tried in this order: triton_gemv.py's GEMV (one row, CUDA: the
batch-1 decode step), triton_wo.py's Triton kernel (codes dequantized in the GEMM's inner loop, CUDA, at
most 16 rows), both declining without Triton or off CUDA, then inductor_wo.py's fused reduction (one row,
only while torch.compile traces: the compiled batch-1 decode step on a device without Triton). The order is
measured per Linear on an H200 (benchmarks/wo_kernels.py; benchmarks/RESULTS.md, 2026-11-28 13:14-13:50 UTC):
at one row the GEMV beat triton_wo.py's kernel at every Llama-8B shape (int8 1.26-1.54x bf16's speed per
Linear against 0.69-1.29x) and the reduction at all but the smallest (1024 x 4096), where they are within
~1 us. Neither reaches the 2x that int8's bytes allow (see triton_gemv.py [Note: no integer conversions]).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.inference.inductor_wo import inductor_weight_only
from lightning_zero.inference.triton_gemv import triton_gemv
from lightning_zero.inference.triton_wo import triton_weight_only
from lightning_zero.quant.blocks import Q_MAX, QuantizedBlocks, dequantize, quantize

Kernel = Callable[[Tensor, "QuantLinear"], Optional[Tensor]]
"""``(x, layer) -> y``, or None when it does not apply (device, dtype, shape): the next one is tried."""

_KERNELS: list[Kernel] = [triton_gemv, triton_weight_only, inductor_weight_only]


def register_kernel(kernel: Kernel) -> Callable[[], None]:
    """Add a fused weight-only matmul ([Note: the kernel seam]); returns a function removing it again."""
    _KERNELS.append(kernel)
    return lambda: _KERNELS.remove(kernel)


def quantize_weight(weight: Tensor, bits: int = 8, group_size: int = 128) -> QuantizedBlocks:
    """``weight`` ``[out, in]`` quantized per group of ``group_size`` input features of each row ([Note:
    weight-only groups]); the blocks' ``shape`` is the padded ``[out, in_padded]``."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight takes a 2-D Linear weight, got shape {tuple(weight.shape)}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
    pad = (-weight.shape[1]) % group_size
    padded = F.pad(weight.detach(), (0, pad)) if pad else weight.detach()
    return quantize(padded, bits=bits, block=group_size)


def dequantize_weight(qb: QuantizedBlocks, in_features: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The ``[out, in_features]`` weight ``qb`` stands for, in ``dtype`` (default: the original's)."""
    w = dequantize(qb)[:, :in_features]
    return w if dtype is None else w.to(dtype)


class QuantLinear(nn.Module):
    """An ``nn.Linear`` with its weight held as grouped int8/int4 codes and fp32 scales (buffers, so they
    move with ``.to()`` and travel in the state dict); the bias stays a parameter in its own dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 8,
                 group_size: int = 128, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        if bits not in Q_MAX:
            raise ValueError(f"bits must be one of {sorted(Q_MAX)}, got {bits}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.weight_dtype = bits, group_size, dtype
        padded = in_features + (-in_features) % group_size
        per_byte = 2 if bits == 4 else 1
        self.register_buffer("codes", torch.zeros(out_features * padded // per_byte,
                                                  dtype=torch.uint8 if bits == 4 else torch.int8, device=device))
        self.register_buffer("scales", torch.zeros(out_features * padded // group_size, dtype=torch.float32,
                                                   device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 8, group_size: int = 128) -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, bits=bits, group_size=group_size,
                dtype=linear.weight.dtype, device=linear.weight.device)
        qb = quantize_weight(linear.weight, bits, group_size)
        q.codes.copy_(qb.codes)
        q.scales.copy_(qb.scales)
        if linear.bias is not None and q.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    def blocks(self) -> QuantizedBlocks:
        padded = self.in_features + (-self.in_features) % self.group_size
        return QuantizedBlocks(self.codes, self.scales, self.bits, self.group_size,
                               torch.Size((self.out_features, padded)), self.weight_dtype)

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        return dequantize_weight(self.blocks(), self.in_features, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return weight_only_linear(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}")


def weight_only_linear(x: Tensor, layer: QuantLinear) -> Tensor:
    """``layer(x)``: a registered kernel where one applies, else dequantize-then-matmul ([Note: the kernel seam])."""
    for kernel in _KERNELS:
        y = kernel(x, layer)
        if y is not None:
            return y
    bias = layer.bias.to(x.dtype) if layer.bias is not None else None
    return F.linear(x, layer.dequantized_weight(x.dtype), bias)


def quantize_linears(model: nn.Module, bits: int = 8, group_size: int = 128,
                     skip: Sequence[str] = ()) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`QuantLinear`; ``skip``: fnmatch
    patterns of module names to keep (e.g. ``["lm_head"]``). Returns the names replaced. Weights read
    outside their Linear (a tied head's ``F.linear(h, wte.weight)``) are not Linears and stay as they are."""
    names = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(fnmatch.fnmatchcase(name, p) for p in skip):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(module, bits, group_size))
        names.append(name)
    return names
