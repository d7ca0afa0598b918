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
with the same dequantize-then-sum at each: :func:`start_reduce_scatter_hierarchical`, whose second level
re-quantizes the fp32 partial sums, so its error is one more set of half-steps, not a product). Each
returns the bytes this rank sent (comm/traffic.py [Note: counting bytes sent]), so a caller can count a
step's traffic.

[Note: codes on the wire]
A shard is quantized in whole blocks (its last block zero-padded), but only the codes of its real
elements travel (``numel`` bytes in int8, ``ceil(numel / 2)`` in int4) with one fp32 scale per block; the
receiver pads them back with zero codes. Stage 3's chunks are often smaller than one block, where the
padding would otherwise cost more than the codes. On CUDA with Triton, quant/triton_blocks.py's fused kernels
produce and consume this same format ([Note: fused quantize kernels]): the functions below are their
definition and the CPU path. A piece's scales and codes travel packed in one row of
bytes, so each quantized collective is one exchange. The ``start_*`` forms are asynchronous: they launch
the exchanges and return a :class:`QuantizedWork` whose ``wait`` dequantizes (and sums) once they are in,
as the exact collectives' work handles let stage 3 overlap its gathers and reductions.

[Note: qgZ into the gradient shard]
A reduce-scatter's sum is, in stage 3, bound for a chunk of the fp32 gradient shard: copied there by the
first backward after a step, added there by the others (gradient accumulation). Returning a fresh fp32
tensor for the engine to copy cost one more read and write of every shard element per backward (estimated
~2 ms of GPT-xl's ~146 ms step on one H200, issue #33). So the reductions take ``into``, called when they
finish, which names the destination chunk and whether to add to it (flat_group.py ``grad_chunk_to_write``);
:func:`dequantize_sum` writes the mean there (one kernel on CUDA; on CPU ``torch.sum(..., out=)``, then
``div_`` in place), or adds it (the kernel: load, add, store; eager: the mean, then ``add_``). Every value
is the one the two steps produced, bit for bit: the same sum in the same order and the same division or
reciprocal product, rounded once to fp32, then copied or added (tests/quant/test_qgz_direct.py). A
destination that is not contiguous fp32 (``grad_shard_precision="bf16"``), and the eager path on CUDA
(a block that is not a power of two), get the two steps.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.quant import triton_blocks as fused
from lightning_zero.quant.blocks import Q_MAX, _unpack_int4, quantize


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the codes of ``numel`` elements on the wire ([Note: codes on the wire])."""
    return numel if bits == 8 else (numel + 1) // 2


def quantized_nbytes(numel: int, bits: int, block: int) -> int:
    """Bytes one quantized piece of ``numel`` elements takes on the wire: codes and fp32 scales (one packed
    row of :func:`_quantize_rows`)."""
    return code_bytes(numel, bits) + math.ceil(numel / block) * 4


class QuantizedWork:
    """A launched quantized collective. ``wait`` waits for its exchanges and finishes it (dequantize,
    and sum for reductions) once; ``result`` is then what it produced (None for gathers into ``out``).
    ``nbytes``: what this rank sends, known at launch; ``levels``: the same per level of a hierarchy."""

    def __init__(self, works: list[Any], finish: Callable[[], Optional[Tensor]], levels: tuple[int, ...]) -> None:
        self._works = works
        self._finish: Optional[Callable[[], Optional[Tensor]]] = finish
        self.levels = levels
        self.nbytes = sum(levels)
        self.result: Optional[Tensor] = None

    def wait(self) -> bool:
        if self._finish is not None:
            for w in self._works:
                w.wait()
            finish, self._finish = self._finish, None
            self.result = finish()
        return True


def _quantize_rows(rows: Tensor, bits: int, block: int, out: Optional[Tensor] = None,
                   interleave: int = 1, seed: Optional[int] = None) -> Tensor:
    """Each row of ``rows`` quantized on its own (blocks never straddle rows) and packed as one row of bytes:
    its fp32 scales, then the codes of its real elements ([Note: codes on the wire]); one exchange sends
    both. Flat, ``n x quantized_nbytes(numel, ...)``, in ``out`` if given (contiguous uint8 of that size).
    ``interleave = k``: the rows of ``rows.reshape(k, n, numel // k).transpose(0, 1)`` instead (hpZ's
    arrangement; the fused kernel reads them in place: triton_blocks.py [Note: no arranged copy]).
    ``seed``: codes rounded stochastically (quant/blocks.py [Note: stochastic rounding of codes]).
    On CUDA, the fused kernel (equal bytes)."""
    if fused.fused_applies(rows, block):
        return fused.quantize_rows(rows, bits, block, out, interleave, seed)
    if interleave > 1:
        n, numel = rows.shape
        rows = rows.reshape(interleave, n, numel // interleave).transpose(0, 1).reshape(n, numel)
    return _quantize_rows_eager(rows, bits, block, out, seed)


def _quantize_rows_eager(rows: Tensor, bits: int, block: int, out: Optional[Tensor] = None,
                         seed: Optional[int] = None) -> Tensor:
    """:func:`_quantize_rows` in pure torch: the definition, and the path off CUDA."""
    n, numel = rows.shape
    pad = (-numel) % block
    padded = F.pad(rows.detach(), (0, pad)) if pad and n > 1 else rows  # one row: quantize pads its last block
    qb = quantize(padded, bits=bits, block=block, seed=seed)
    nb, wire = math.ceil(numel / block), code_bytes(numel, bits)
    if out is not None:
        packed = out.view(n, nb * 4 + wire)
    else:
        packed = torch.empty(n, nb * 4 + wire, dtype=torch.uint8, device=rows.device)
    packed[:, : nb * 4] = qb.scales.view(n, nb).view(torch.uint8)
    packed[:, nb * 4 :] = qb.codes.view(n, -1)[:, :wire].view(torch.uint8)
    return packed.view(-1)


def _dequantize_rows(packed: Tensor, n: int, numel: int, bits: int, block: int) -> Tensor:
    """fp32 ``[n, numel]`` from ``n`` packed rows (inverse of :func:`_quantize_rows`)."""
    nb, wire = math.ceil(numel / block), code_bytes(numel, bits)
    rows = packed.view(n, nb * 4 + wire)
    scales = torch.empty(n, nb * 4, dtype=torch.uint8, device=packed.device)  # fresh: 4-byte aligned rows
    scales = scales.copy_(rows[:, : nb * 4]).view(torch.float32)
    per_row = nb * block // (1 if bits == 8 else 2)
    codes = rows[:, nb * 4 :]
    if wire < per_row:  # the last block's padding comes back as zero codes
        codes = torch.zeros(n, per_row, dtype=torch.uint8, device=packed.device)
        codes[:, :wire] = rows[:, nb * 4 :]
    q = _unpack_int4(codes.reshape(-1)) if bits == 4 else codes.view(torch.int8)
    values = q.view(n, nb, block) * scales.view(n, nb, 1)  # int8 x fp32: fp32 in one pass
    return values.view(n, -1)[:, :numel]


def dequantize_sum(received: Tensor, n: int, numel: int, bits: int, block: int, divisor: int = 1,
                   out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """The fp32 sum of the ``n`` packed rows of ``received`` (dequantized, added in rank order), divided by
    ``divisor``; written into ``out`` or, with ``accumulate``, added to it (then returned), else a new tensor
    ([Note: qgZ into the gradient shard]). The fused kernel on CUDA, bit for bit the eager definition."""
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    if fused.fused_applies(received, block):  # one pass: dequantized, summed, divided, stored (or added)
        if direct:
            return fused.dequantize_sum(received, n, numel, bits, block, divisor, out=out, accumulate=accumulate)
        total = fused.dequantize_sum(received, n, numel, bits, block, divisor)
    else:
        rows = _dequantize_rows(received, n, numel, bits, block)
        if direct and not accumulate and not received.is_cuda:  # CUDA's reduction may tile by out's alignment
            total = torch.sum(rows, 0, out=out)  # type: ignore[arg-type]
            return total.div_(divisor) if divisor != 1 else total
        total = rows.sum(0)
        if divisor != 1:
            total.div_(divisor)
    if out is None:
        return total
    return out.add_(total) if accumulate else out.copy_(total)


def start_all_gather(out: Tensor, shard: Tensor, group: Optional[C.ProcessGroup], bits: int = 8,
                     block: int = 2048) -> QuantizedWork:
    """Launch the quantized all-gather of every rank's equal ``shard`` into ``out`` (flat, rank order,
    ``n x shard.numel()`` elements, any float dtype); ``wait`` dequantizes into it."""
    n = C.world_size(group)
    numel = shard.numel()
    row = quantized_nbytes(numel, bits, block)
    every = torch.empty(n * row, dtype=torch.uint8, device=shard.device)
    me = C.rank(group) if n > 1 else 0
    mine = every[me * row : (me + 1) * row]  # quantized in place: an in-place all-gather, no copy of it
    _quantize_rows(shard.reshape(1, -1), bits, block, out=mine)
    work = C.all_gather(every, mine, group, async_op=True)

    def finish() -> None:
        if fused.fused_applies(out, block) and out.is_contiguous():  # straight into out, in its dtype
            fused.dequantize_rows_into(out, every, n, numel, bits, block)
        else:
            out.view(n, numel).copy_(_dequantize_rows(every, n, numel, bits, block))
        return None

    return QuantizedWork([work], finish, ((n - 1) * mine.numel(),))


Into = Callable[[], tuple[Tensor, bool]]
"""Where a reduction's result goes, asked when it finishes: the destination and whether to add to it
([Note: qgZ into the gradient shard])."""


def start_reduce_scatter(full: Tensor, group: Optional[C.ProcessGroup], bits: int = 8, block: int = 2048,
                         divisor: int = 1, into: Optional[Into] = None, interleave: int = 1,
                         seed: Optional[int] = None) -> QuantizedWork:
    """Launch the quantized reduce-scatter of ``full`` (flat, ``numel`` divisible by the group size): one
    all-to-all of each rank's per-destination chunks; ``wait`` leaves this rank's chunk of the sum over
    ranks in ``result``, fp32, summed from the dequantized contributions in rank order, then divided by
    ``divisor`` (stage 3's data-parallel mean, in the same pass on CUDA). With ``into``, ``wait`` writes it
    (or adds it) into the destination ``into()`` gives instead, and ``result`` is that destination.
    ``interleave``: the chunks of ``full`` as :func:`_quantize_rows` arranges them (hpZ's two levels);
    ``seed``: codes rounded stochastically (quant/blocks.py [Note: stochastic rounding of codes])."""
    n = C.world_size(group)
    flat = full.reshape(-1)
    if flat.numel() % n:
        raise ValueError(f"{flat.numel()} elements do not split into {n} equal chunks")
    m = flat.numel() // n
    packed = _quantize_rows(flat.view(n, m), bits, block, interleave=interleave, seed=seed)
    received = torch.empty_like(packed)
    work = C.all_to_all(received, packed, group, async_op=True)

    def finish() -> Tensor:
        out, accumulate = into() if into is not None else (None, False)
        return dequantize_sum(received, n, m, bits, block, divisor, out, accumulate)

    return QuantizedWork([work], finish, ((n - 1) * quantized_nbytes(m, bits, block),))


class TwoLevelWork(QuantizedWork):
    """:func:`start_reduce_scatter_hierarchical`'s handle: the inner level in flight, the outer one launched by
    :meth:`advance` (or ``wait``), which needs the inner sums."""

    def __init__(self, first: QuantizedWork, outer: Optional[C.ProcessGroup], bits: int, block: int,
                 levels: tuple[int, ...], divisor: int = 1, into: Optional[Into] = None,
                 seed: Optional[int] = None) -> None:
        super().__init__([], self._finish_both, levels)
        self._first, self._outer, self._bits, self._block = first, outer, bits, block
        self._divisor, self._into, self._seed = divisor, into, seed
        self._second: Optional[QuantizedWork] = None

    def advance(self) -> None:
        """Finish the inner level and launch the outer one. A collective on the outer group: every rank of
        it must advance its works in the same order (the launch order)."""
        if self._second is None:
            self._first.wait()
            inner_sums: Tensor = self._first.result  # type: ignore[assignment]
            self._second = start_reduce_scatter(inner_sums, self._outer, self._bits, self._block, self._divisor,
                                                self._into, seed=self._seed)

    def _finish_both(self) -> Optional[Tensor]:
        self.advance()
        assert self._second is not None
        self._second.wait()
        return self._second.result


def start_reduce_scatter_hierarchical(full: Tensor, inner: Optional[C.ProcessGroup], outer: Optional[C.ProcessGroup],
                                      bits: int = 8, block: int = 2048, divisor: int = 1,
                                      into: Optional[Into] = None, seeds: Optional[tuple[int, int]] = None
                                      ) -> TwoLevelWork:
    """Two-level quantized reduce-scatter over ``inner`` (``h`` contiguous ranks, a node) then ``outer`` (the
    ``k`` ranks of equal position in each node): the ``n = k h`` chunks of ``full`` are reordered so that
    the inner exchange sends each rank the chunks of the ranks sharing its position; their fp32 sums are
    re-quantized and exchanged across nodes. ``result`` (fp32) is this rank's chunk ``node * h + local`` of
    the sum (divided by ``divisor`` at the outer level, and written by ``into`` as :func:`start_reduce_scatter`
    writes it), as :func:`start_reduce_scatter` over all ``n`` would give. The outer level starts in
    ``advance`` or ``wait`` (it needs the inner sums): callers advance and wait in the same order on
    every rank. ``seeds``: each level's codes rounded stochastically from its own seed (inner, outer)."""
    h, k = C.world_size(inner), C.world_size(outer)
    flat = full.reshape(-1)
    if flat.numel() % (h * k):
        raise ValueError(f"{flat.numel()} elements do not split into {h * k} equal chunks")
    m = flat.numel() // (h * k)
    # part l: the chunks of every node's rank l (flat.view(k, h, m).transpose(0, 1)), read in place on CUDA
    inner_seed, outer_seed = seeds if seeds is not None else (None, None)
    first = start_reduce_scatter(flat, inner, bits, block, interleave=k, seed=inner_seed)
    return TwoLevelWork(first, outer, bits, block, (first.nbytes, (k - 1) * quantized_nbytes(m, bits, block)),
                        divisor, into, outer_seed)


def all_gather(shard: Tensor, group: Optional[C.ProcessGroup], bits: int = 8, block: int = 2048) -> tuple[Tensor, int]:
    """Every rank's equal ``shard`` concatenated (flat, rank order) from their quantized form; returns the
    result in ``shard``'s dtype and the bytes this rank sent."""
    out = torch.empty(C.world_size(group) * shard.numel(), dtype=shard.dtype, device=shard.device)
    work = start_all_gather(out, shard, group, bits, block)
    work.wait()
    return out, work.nbytes


def reduce_scatter(full: Tensor, group: Optional[C.ProcessGroup], bits: int = 8, block: int = 2048,
                   seed: Optional[int] = None) -> tuple[Tensor, int]:
    """This rank's chunk of the sum over ranks of ``full`` (flat, ``numel`` divisible by the group size),
    summed in fp32 from quantized contributions (rounded stochastically from ``seed`` if given); returns it
    in ``full``'s dtype and the bytes sent."""
    work = start_reduce_scatter(full, group, bits, block, seed=seed)
    work.wait()
    return work.result.to(full.dtype), work.nbytes  # type: ignore[union-attr]


__all__ = ["Into", "Q_MAX", "QuantizedWork", "TwoLevelWork", "all_gather", "code_bytes", "dequantize_sum",
           "quantized_nbytes", "reduce_scatter", "start_all_gather", "start_reduce_scatter",
           "start_reduce_scatter_hierarchical"]
