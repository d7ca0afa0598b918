"""Copying writes made outside the optimizer into the fp32 masters: the eager reference and its fused kernel.

[Note: the merge's cost]
flat_group.py [Note: writes outside the optimizer] compares, before every optimizer step, each rank's
chunk of the 16-bit parameters with its rounded fp32 master and takes the elements that differ. In eager
torch that is four kernels and two temporaries per bucket (the master rounded, the comparison, the chunk
widened, the ``where``): about 30 bytes of memory traffic per element, to find, nearly always, that
nothing changed. On 2 H200s at EP 2 (RESULTS.md 2026-11-29 20:33) an MoE rank holds 2.06G master
elements, and those kernels were some 15-20 ms of its 228 ms step (the ``where`` alone 6.4 ms in 147
launches), a cost every stage 0-2 run with 16-bit compute pays in proportion to its shard. The Triton
kernel does the same in one pass: it reads the chunk (2 bytes) and the master (4) and writes only the
changed elements, bit for bit the reference's result: the comparison is IEEE (``-0.0`` equals ``0.0``,
NaN differs from everything), the master is rounded to nearest even as torch's cast rounds, and a
changed element is widened bit-exactly (NaN payloads kept). Used for bf16 chunks of fp32 masters on
CUDA with Triton installed; everything else takes the reference. The GPU test
(tests/zero/test_merge_writes.py, marked ``gpu``) checks the equality.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.optim.triton_adam import _BLOCK, tl, triton  # one import guard for Triton


def merge_param_writes_reference(live: Tensor, master: Tensor) -> None:
    """The rule of [Note: writes outside the optimizer], in eager torch: ``live`` (the parameters' chunk) into
    ``master`` (any device): the same dtype copies; 16-bit compute takes only the elements that differ from
    the rounded master, so untouched elements keep their full-precision bits."""
    live = live.to(master.device)
    if live.dtype == master.dtype:
        master.copy_(live)
    else:
        torch.where(live != master.to(live.dtype), live.to(master.dtype), master, out=master)


if triton is not None:

    @triton.jit
    def _merge_bf16_kernel(live_ptr, master_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        bits = tl.load(live_ptr + offsets, mask=mask, other=0)  # bf16 bit patterns (int16)
        live = (bits.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)  # exact widening
        master = tl.load(master_ptr + offsets, mask=mask, other=0.0)
        rounded = master.to(tl.bfloat16).to(tl.float32)  # round to nearest even, then exact
        changed = live != rounded
        tl.store(master_ptr + offsets, live, mask=mask & changed)


def fused_applies(live: Tensor, master: Tensor) -> bool:
    """Whether :func:`merge_param_writes` takes the kernel: a bf16 chunk of an fp32 master, both contiguous
    on one CUDA device with native bf16 (compute capability 8.0 or newer), Triton installed."""
    return (triton is not None and live.is_cuda and master.device == live.device and live.dtype == torch.bfloat16
            and master.dtype == torch.float32 and live.is_contiguous() and master.is_contiguous()
            and live.numel() == master.numel() and torch.cuda.get_device_capability(live.device) >= (8, 0))


def merge_param_writes(live: Tensor, master: Tensor) -> None:
    """:func:`merge_param_writes_reference`'s result, in one pass where :func:`fused_applies` (see the Note)."""
    if not fused_applies(live, master):
        merge_param_writes_reference(live, master)
        return
    n = master.numel()
    if n:
        _merge_bf16_kernel[(triton.cdiv(n, _BLOCK),)](live.view(torch.int16), master, n, BLOCK=_BLOCK)
