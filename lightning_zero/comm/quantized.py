"""Quantized collectives (issue #33, ZeRO++'s qwZ and qgZ), built on comm/collectives.py's exchanges of the
block-quantized format (quant/blocks.py).

[Note: quantized collectives]
*All-gather (qwZ)*: each rank quantizes its shard once; codes and scales are all-gathered (every rank's are
the same size, since shards are equal) and each received shard is dequantized. Every element is then within
half a quantization step of its rank's value. *Reduce-scatter (qgZ)*: each rank cuts its tensor into one
chunk per rank and quantizes each chunk on its own (its own scales); one all-to-all sends chunk ``j`` to rank
``j``, which dequantizes the ``N`` chunks it received in fp32 and sums them. Summing after dequantizing, in
fp32, is what keeps the error from compounding: the result is within ``sum_r step_r / 2`` of the exact sum,
the half-steps of the ``N`` contributions (DeepSpeed's qgZ reduces over two levels, intra- then inter-node,
with the same dequantize-then-sum at each; one level here). Both return the bytes this rank sent, so a
caller can count a step's traffic.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.quant.blocks import QuantizedBlocks, dequantize, quantize


def _like(qb: QuantizedBlocks, codes: Tensor, scales: Tensor, shape: torch.Size) -> QuantizedBlocks:
    return QuantizedBlocks(codes, scales, qb.bits, qb.block, shape, qb.dtype)


def all_gather(shard: Tensor, group: Optional[C.ProcessGroup], bits: int = 8, block: int = 2048) -> tuple[Tensor, int]:
    """Every rank's equal ``shard`` concatenated (flat, rank order) from their quantized form; returns the
    result in ``shard``'s dtype and the bytes this rank sent."""
    n = C.world_size(group)
    qb = quantize(shard, bits=bits, block=block)
    codes = torch.empty(n * qb.codes.numel(), dtype=qb.codes.dtype, device=shard.device)
    scales = torch.empty(n * qb.scales.numel(), dtype=torch.float32, device=shard.device)
    C.all_gather(codes, qb.codes, group)
    C.all_gather(scales, qb.scales, group)
    parts = [dequantize(_like(qb, c, s, shard.shape)).reshape(-1)
             for c, s in zip(codes.chunk(n), scales.chunk(n))]
    return torch.cat(parts), qb.nbytes * (n - 1)


def reduce_scatter(full: Tensor, group: Optional[C.ProcessGroup], bits: int = 8, block: int = 2048) -> tuple[Tensor, int]:
    """This rank's chunk of the sum over ranks of ``full`` (flat, ``numel`` divisible by the group size),
    summed in fp32 from quantized contributions; returns it in ``full``'s dtype and the bytes sent."""
    n, r = C.world_size(group), C.rank(group)
    flat = full.reshape(-1)
    if flat.numel() % n:
        raise ValueError(f"{flat.numel()} elements do not split into {n} equal chunks")
    chunks = [quantize(c, bits=bits, block=block) for c in flat.chunk(n)]
    codes_in = torch.cat([q.codes for q in chunks])
    scales_in = torch.cat([q.scales for q in chunks])
    codes_out, scales_out = torch.empty_like(codes_in), torch.empty_like(scales_in)
    C.all_to_all(codes_out, codes_in, group)
    C.all_to_all(scales_out, scales_in, group)
    total = torch.zeros(flat.numel() // n, dtype=torch.float32, device=full.device)
    for c, s in zip(codes_out.chunk(n), scales_out.chunk(n)):
        total += dequantize(_like(chunks[0], c, s, chunks[0].shape)).float().reshape(-1)
    sent = sum(q.nbytes for i, q in enumerate(chunks) if i != r)
    return total.to(full.dtype), sent
