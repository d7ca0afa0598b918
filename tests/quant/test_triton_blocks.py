"""The fused Triton kernels of the quantized collectives (quant/triton_blocks.py) against the eager definition
(comm/quantized.py's ``_quantize_rows``/``_dequantize_rows``), bit for bit.

On a GPU (marked ``gpu``: ``python -m pytest tests/quant/test_triton_blocks.py -m gpu``) the kernels run on
CUDA tensors and the eager reference on CPU copies (the definition: on CUDA, eager ``max|x| / q_max`` would
multiply by a rounded reciprocal, which can differ by one ulp); everything must be equal: the packed wire
bytes (scales and codes, int8 and int4, exact ties ``k + 1/2`` rounding to even included), the dequantized
rows written in the destination's dtype, and qgZ's fp32 dequantize-and-sum over ``n = 1..4`` rows (and its
division by the data-parallel size), also written into, then added to, a chunk of an fp32 gradient shard;
rows quantized into a slot of a larger buffer (qwZ), and read in hpZ's interleaved order in place; codes rounded
stochastically from a seed (qgZ's ``gradient_rounding="stochastic"``), plain and interleaved. Without a GPU, when Triton is installed, the same comparison runs in
Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess), where everything is compared bit for bit but
the dequantized rows are written in fp32 only: the interpreter's fp32 to bf16 conversion neither rounds to
nearest even nor carries a rounded-up mantissa into the exponent (CUDA's does both), so only the GPU test
checks the bf16 destination. Sizes: one element, odd counts, smaller than a block, a whole number of blocks, a
partial last block; inputs in fp32 and bf16 spanning five decades, with an all-zero block and a NaN block
(whose scale is NaN and values all NaN; the NaN element's own code is undefined, as eager's cast of NaN is).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from lightning_zero.comm.quantized import _dequantize_rows, _quantize_rows_eager
from lightning_zero.quant.triton_blocks import triton_available
from tests.helpers.launch import ROOT

Q = {8: 127, 4: 7}


def _rows(n: int, numel: int, bits: int, block: int, dtype: torch.dtype, case: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(numel * 31 + n * 7 + bits)
    if case == "ties":  # scale exactly 1 (each block's first element q_max): every other code is a tie k + 1/2
        q = Q[bits]
        x = (torch.arange(n * numel) % (2 * q) - q + 0.5).view(n, numel)
        x[:, ::block] = q
    else:
        x = torch.randn(n, numel, generator=gen) * torch.logspace(-3, 2, numel)
        if case == "special":
            x[:, :block] = 0.0  # an all-zero block: scale 0, codes 0
            if numel > block:
                x[0, block] = float("nan")  # a NaN block: NaN scale, non-finite values
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (bit-for-bit comparisons: -0 differs from +0)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs matched by position (their payloads are not defined)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a.masked_fill(nan, 0)), _bits(b.masked_fill(nan, 0)))


def compare(device: str, exact_16bit_out: bool) -> list[str]:
    """Mismatch descriptions; empty when the kernels equal the eager reference everywhere."""
    from lightning_zero.quant import triton_blocks as fused

    bad = []
    for bits, block, numel, n, dtype, case in itertools.product(
            (8, 4), (32, 256), (1, 7, 32, 33, 255, 513), (1, 2, 3, 4), (torch.float32, torch.bfloat16),
            ("random", "ties", "special")):
        where = f"bits={bits} block={block} numel={numel} n={n} {dtype} {case}"
        x = _rows(n, numel, bits, block, dtype, case)
        ref = _quantize_rows_eager(x, bits, block)
        got = fused.quantize_rows(x.to(device), bits, block).cpu()
        if numel % 3 == 0 and case != "special":  # hpZ's arrangement of 3 nodes' chunks, read in place
            arranged = x.reshape(3, n, numel // 3).transpose(0, 1).reshape(n, numel)
            if not torch.equal(fused.quantize_rows(x.to(device), bits, block, interleave=3).cpu(),
                               _quantize_rows_eager(arranged, bits, block)):
                bad.append(f"{where}: quantizing the interleaved rows in place differs")
        if case != "special":  # stochastic rounding (qgZ): the kernel's hash draws the reference's bits
            seed = numel * 1_000_003 + n
            arranged = x.reshape(3, n, numel // 3).transpose(0, 1).reshape(n, numel) if numel % 3 == 0 else None
            if not torch.equal(fused.quantize_rows(x.to(device), bits, block, seed=seed).cpu(),
                               _quantize_rows_eager(x, bits, block, seed=seed)):
                bad.append(f"{where}: stochastically rounded bytes differ")
            elif arranged is not None and not torch.equal(
                    fused.quantize_rows(x.to(device), bits, block, interleave=3, seed=seed).cpu(),
                    _quantize_rows_eager(arranged, bits, block, seed=seed)):
                bad.append(f"{where}: stochastically rounded interleaved bytes differ")
        if n == 1:  # qwZ quantizes into its own slot of the gathered bytes: the same bytes, nothing else touched
            every = torch.full((3 * got.numel(),), 0xA5, dtype=torch.uint8, device=device)
            fused.quantize_rows(x.to(device), bits, block, out=every[got.numel() : 2 * got.numel()])
            slot = every.cpu().clone().view(3, -1)
            if not (torch.equal(slot[1], got) and bool((slot[0] == 0xA5).all()) and bool((slot[2] == 0xA5).all())):
                bad.append(f"{where}: quantizing into a slot of the gathered bytes differs")
        if case == "special" and numel > block:  # the NaN's own code is not defined (a cast of NaN to int8)
            at = (numel + block - 1) // block * 4 + (block if bits == 8 else block // 2)
            keep = 0xF0 if bits == 4 else 0  # under int4 the NaN (an even element) is the byte's low nibble
            ref[at], got[at] = ref[at] & keep, got[at] & keep
        if not torch.equal(ref, got):
            bad.append(f"{where}: packed bytes differ in {int((ref != got).sum())} of {ref.numel()}")
            continue
        values = _dequantize_rows(ref, n, numel, bits, block)  # fp32 [n, numel]
        out_dtype = dtype if exact_16bit_out else torch.float32
        out = torch.empty(n * numel, dtype=out_dtype, device=device)
        fused.dequantize_rows_into(out, ref.to(device), n, numel, bits, block)
        if not _same(out.cpu().view(n, numel), values.to(out_dtype)):
            bad.append(f"{where}: dequantized rows differ")
        total = fused.dequantize_sum(ref.to(device), n, numel, bits, block).cpu()
        want_sum = values.sum(0)
        if not _same(total, want_sum):
            bad.append(f"{where}: sums differ by up to {float((total - want_sum).nan_to_num().abs().max())}")
        if n == 3:  # stage 3's mean over 3 ranks: times the fp32 reciprocal (CUDA's div_ by a number)
            mean = fused.dequantize_sum(ref.to(device), n, numel, bits, block, divisor=3).cpu()
            if not _same(mean, want_sum * torch.tensor(1 / 3, dtype=torch.float32)):
                bad.append(f"{where}: the sum divided by 3 differs")
        # written into the fp32 gradient shard's chunk (an odd offset), then added to it (accumulation): as
        # the eager copy_ / add_ of the mean ([Note: qgZ into the gradient shard]), nothing else touched
        divisor = 3 if n == 3 else 1
        mean = want_sum * torch.tensor(1 / 3, dtype=torch.float32) if divisor == 3 else want_sum
        shard = torch.full((numel + 9,), 7.0, device=device)
        chunk = shard[5 : 5 + numel]
        fused.dequantize_sum(ref.to(device), n, numel, bits, block, divisor=divisor, out=chunk)
        into = shard.cpu().clone()  # (on CPU, .cpu() is the same tensor)
        fused.dequantize_sum(ref.to(device), n, numel, bits, block, divisor=divisor, out=chunk, accumulate=True)
        added = shard.cpu()
        frame = torch.full((numel + 9,), 7.0)
        if not (_same(into[5 : 5 + numel], mean) and _same(added[5 : 5 + numel], mean + mean)
                and torch.equal(into[:5], frame[:5]) and torch.equal(added[5 + numel :], frame[5 + numel :])):
            bad.append(f"{where}: the sum written or added into the shard differs")
        if case == "special" and numel > block and not bool(total[block : 2 * block].isnan().all()):
            bad.append(f"{where}: a NaN block's values are not all NaN")
    return bad


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU and Triton")
def test_kernels_equal_the_reference_on_cuda() -> None:
    assert compare("cuda", exact_16bit_out=True) == []


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU and Triton")
def test_collectives_take_the_fused_path_on_cuda() -> None:
    """comm/quantized.py's one-process collectives on CUDA (no process group: a copy of this rank's pieces)
    equal their eager results on CPU copies bit for bit, at stage 3's block size."""
    from lightning_zero.comm import quantized

    x = torch.randn(3 * 5000 + 2, generator=torch.Generator().manual_seed(3)).bfloat16()
    for bits in (8, 4):
        g_cuda, _ = quantized.all_gather(x.cuda(), None, bits=bits, block=2048)
        g_cpu, _ = quantized.all_gather(x, None, bits=bits, block=2048)
        assert _same(g_cuda.cpu(), g_cpu)
        r_cuda, _ = quantized.reduce_scatter(x.float().cuda(), None, bits=bits, block=2048)
        r_cpu, _ = quantized.reduce_scatter(x.float(), None, bits=bits, block=2048)
        assert _same(r_cuda.cpu(), r_cpu)
        shard = torch.zeros(x.numel() + 3, device="cuda")  # qgZ into the gradient shard: copied, then added
        for accumulate in (False, True):
            work = quantized.start_reduce_scatter(x.float().cuda(), None, bits, 2048,
                                                  into=lambda a=accumulate: (shard[3:], a))
            work.wait()
        assert _same(shard[3:].cpu(), r_cpu + r_cpu) and not bool(shard[:3].any())


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_kernels_equal_the_reference_in_the_interpreter() -> None:
    code = ("from tests.quant.test_triton_blocks import compare; bad = compare('cpu', exact_16bit_out=False); "
            "print(bad); assert not bad")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
