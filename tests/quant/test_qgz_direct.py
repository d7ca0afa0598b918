"""qgZ's dequantize-and-sum written straight into the fp32 gradient shard (comm/quantized.py [Note: qgZ into
the gradient shard]) against the two steps it replaces, bit for bit, on CPU (the eager form; the Triton form
is held to the same reference in tests/quant/test_triton_blocks.py).

The reference is the code the engine ran before: ``_dequantize_rows(...).sum(0)``, ``div_`` by the
data-parallel size where it is not 1, then ``copy_`` into the shard's chunk (the first backward after a
step) or ``add_`` to it (gradient accumulation). The destination is a chunk of a larger shard at an odd
offset, as stage 3's buckets are; ``n = 1..4`` received rows, int8 and int4, sizes below, at and past a
block, values spanning five decades.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_zero.comm import quantized
from lightning_zero.comm.quantized import _dequantize_rows, _quantize_rows_eager


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _two_steps(packed: torch.Tensor, n: int, numel: int, bits: int, block: int, divisor: int,
               chunk: torch.Tensor, accumulate: bool) -> None:
    """The previous path: a fresh fp32 mean (comm/quantized.py), then stage 3's ``add_to_grad_shard``."""
    total = _dequantize_rows(packed, n, numel, bits, block).sum(0)
    if divisor != 1:
        total.div_(divisor)
    chunk.add_(total) if accumulate else chunk.copy_(total)


@pytest.mark.parametrize("bits", [8, 4])
def test_direct_write_equals_dequantize_sum_then_copy_or_add(bits: int) -> None:
    checked = 0
    for block, numel, n, divisor in itertools.product((32, 256), (1, 7, 255, 513, 4099), (1, 2, 3, 4), (1, 3)):
        gen = torch.Generator().manual_seed(numel * 31 + n * 7 + bits + divisor)
        x = torch.randn(n, numel, generator=gen) * torch.logspace(-3, 2, numel)
        packed = _quantize_rows_eager(x, bits, block)
        prev = torch.randn(numel, generator=gen)  # what the first micro-batch left in the shard
        for accumulate in (False, True):
            ref_shard = torch.full((numel + 9,), 7.0)
            ref = ref_shard[5 : 5 + numel]
            ref.copy_(prev)
            _two_steps(packed, n, numel, bits, block, divisor, ref, accumulate)
            shard = torch.full((numel + 9,), 7.0)
            chunk = shard[5 : 5 + numel]
            chunk.copy_(prev)
            got = quantized.dequantize_sum(packed, n, numel, bits, block, divisor, out=chunk, accumulate=accumulate)
            assert got.data_ptr() == chunk.data_ptr()  # written in place, no new tensor
            assert torch.equal(_bits(shard), _bits(ref_shard)), (block, numel, n, divisor, accumulate)
            assert accumulate or not torch.equal(chunk, prev)  # the write did happen
            checked += 1
    assert checked == 2 * 2 * 5 * 4 * 2


def test_reductions_write_where_into_says() -> None:
    """``into`` reaches the last level of both reductions: one process, where the all-to-all is a copy, the
    flat and the two-level reduce-scatter leave in the destination what their ``result`` held before,
    copied, then added on a second call."""
    x = torch.randn(3 * 600, generator=torch.Generator().manual_seed(5))
    for start in (quantized.start_reduce_scatter, quantized.start_reduce_scatter_hierarchical):
        args = (x, None) if start is quantized.start_reduce_scatter else (x, None, None)
        plain = start(*args, bits=4, block=256, divisor=2)
        plain.wait()
        want = plain.result.clone()
        out = torch.full_like(want, float("nan"))
        for accumulate, expect in ((False, want), (True, want + want)):
            work = start(*args, bits=4, block=256, divisor=2, into=lambda a=accumulate: (out, a))
            work.wait()
            assert work.result is out and torch.equal(out, expect)


def test_a_destination_that_is_not_contiguous_fp32_gets_the_two_steps() -> None:
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    packed = _quantize_rows_eager(x, 8, 256)
    want = _dequantize_rows(packed, 2, 300, 8, 256).sum(0)
    strided = torch.zeros(600)[::2]
    wide = torch.zeros(300, dtype=torch.float64)
    quantized.dequantize_sum(packed, 2, 300, 8, 256, out=strided)
    quantized.dequantize_sum(packed, 2, 300, 8, 256, out=wide)
    quantized.dequantize_sum(packed, 2, 300, 8, 256, out=wide, accumulate=True)
    assert torch.equal(strided, want) and torch.equal(wide, 2 * want.double())
