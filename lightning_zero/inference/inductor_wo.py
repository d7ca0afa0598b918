"""Weight-only int8 / int4 for one row inside ``torch.compile``: the product written as a reduction inductor fuses.

[Note: one-row decode as a fused reduction]
At batch 1 a decode step multiplies one row ``x [1, K]`` by every weight, so its time is the bytes it reads.
Written as dequantize-then-``F.linear`` (quant.py's reference), even compiled, the dequantized bf16 weight
is written and read again: slower than the unquantized layer. Written instead as one reduction over K of
``x[k] * scale[n, k // group] * code[n, k]`` (int4: the low and high nibble against the even and odd input
features), inductor emits one kernel that reads each code once, converts it in registers and accumulates
in fp32: the GEMV reads ~0.52x (int8) or ~0.27x (int4) of bf16's bytes. This is gpt-fast's recipe (its
int8 layer is ``F.linear(x, w.to(dtype)) * scales``, which inductor decomposes the same way at one row
under ``coordinate_descent_tuning``; ``DecodeConfig.coordinate_descent`` turns that tuning on for the
compiled step). Measured on an H200 (benchmarks/RESULTS.md, 2026-11-28 10:37), inductor's kernel for it
decodes int8 Llama-8B at 124.6 tokens/s against bf16's 206.7 in the same run: far from the bytes' bound.
triton_wo.py's kernel gave 169.5 in another call that day (against bf16's 181.3 there), so the seam tries
it first and this path serves where it declines. It applies only
while dynamo traces (eagerly the same expression would materialise an fp32
``[N, K]`` product) and only to one row: at 2-16 rows triton_wo.py's kernel reads the codes once for all
rows, where a reduction per output element would read them once per row.

The sum runs in fp32 over exact ``scale * code`` products, so it agrees with the reference (which rounds the
dequantized weight to the input's dtype first) to within that dtype's matmul rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def reduction_weight_only(x: Tensor, layer: nn.Module) -> Tensor:
    """``layer(x)`` for ``x [..., in_features]`` holding one row, as the fused-reduction expression of
    [Note: one-row decode as a fused reduction]; callable eagerly (tests), meant to be traced."""
    k, n, group = layer.in_features, layer.out_features, layer.group_size
    padded = k + (-k) % group
    groups = padded // group
    row = x.reshape(1, k).float()
    if padded != k:
        row = F.pad(row, (0, padded - k))
    row = row.view(1, groups, group)
    scales = layer.scales.view(n, groups, 1)
    if layer.bits == 8:
        prod = row * (layer.codes.view(n, groups, group).float() * scales)
    else:  # two codes per byte, feature 2i in the low nibble, two's complement (quant/blocks.py's packing)
        packed = layer.codes.view(n, groups, group // 2).to(torch.int32)
        low = ((packed & 15) ^ 8) - 8
        high = (((packed >> 4) & 15) ^ 8) - 8
        prod = (row[..., 0::2] * low.float() + row[..., 1::2] * high.float()) * scales
    y = prod.sum(dim=(1, 2))
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def inductor_weight_only(x: Tensor, layer: nn.Module) -> Optional[Tensor]:
    """The kernel seam's entry (quant.py [Note: the kernel seam]): the fused reduction while dynamo traces a
    one-row product, else None (the next kernel or the reference runs). Declines where autograd would need a
    backward through it (the reference is differentiable the same way, but training never takes one row)."""
    if not torch.compiler.is_compiling() or x.shape[-1] != layer.in_features:
        return None
    if x.numel() != layer.in_features or not x.is_floating_point():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or (layer.bias is not None and layer.bias.requires_grad)):
        return None
    return reduction_weight_only(x, layer)
