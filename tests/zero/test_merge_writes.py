"""The fused merge of writes outside the optimizer (zero/merge_writes.py) against its eager reference.

The reference's rule is checked on CPU (a changed bf16 element replaces its fp32 master, an untouched one
keeps its full-precision bits); on a GPU (marked ``gpu``) the Triton kernel must give the reference's
masters bit for bit: ties of the rounding, -0.0 against 0.0, NaN and inf on either side, subnormals, a
length that is not a multiple of the block, a chunk at an offset of a larger buffer. The training-level
check (a WGAN-style edit reaching the masters at stages 0-2) is tests/unit/test_param_writes.py, which the
GPU run also takes through the kernel.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.zero import merge_writes
from lightning_zero.zero.merge_writes import fused_applies, merge_param_writes, merge_param_writes_reference


def _case(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(live bf16, master fp32): live is the rounded master except at about 1% of the elements, plus the
    edge values of the module docstring at fixed places."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * torch.logspace(-40, 3, n, base=2.0)
    live = master.to(torch.bfloat16)
    changed = torch.rand(n, generator=g) < 0.01
    live[changed] = (torch.randn(int(changed.sum()), generator=g) * 4).to(torch.bfloat16)
    edges = [
        (0.0, -0.0), (-0.0, 0.0),  # (master, live): equal under IEEE: the master keeps its sign
        (1.0 + 2**-8, None), (1.0 + 3 * 2**-8, None),  # rounding ties (None: live = the rounded master)
        (float("nan"), 1.0), (2.0, float("nan")), (float("inf"), None), (3.0, float("-inf")),
        (1e-40, None), (1e-40, 0.0), (3.0e38, None),  # a subnormal master; the largest finite rounds to inf
    ]
    for i, (m, v) in enumerate(edges):
        master[i] = m
        live[i] = torch.tensor(m).to(torch.bfloat16) if v is None else v
    return live, master


def test_the_reference_takes_changed_elements_and_keeps_the_others_bits() -> None:
    live, master = _case(5000, 0)
    before = master.clone()
    merge_param_writes_reference(live, master)
    changed = live != before.to(torch.bfloat16)
    assert changed.any() and (~changed).any()
    assert torch.equal(master[changed].view(torch.int32), live[changed].float().view(torch.int32))  # NaN too
    assert torch.equal(master[~changed].view(torch.int32), before[~changed].view(torch.int32))
    assert str(master[0].item()) == "0.0" and str(master[1].item()) == "-0.0"  # signed zeros are not changes


def test_cpu_and_other_dtypes_take_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(merge_writes, "merge_param_writes_reference", lambda live, master: calls.append(1))
    live, master = _case(100, 1)
    merge_param_writes(live, master)
    merge_param_writes(live.half(), master)
    assert calls == [1, 1] and not fused_applies(live, master)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 1023, 1024, 1_000_003])
def test_the_kernel_equals_the_reference_bit_for_bit(n: int) -> None:
    live, master = _case(max(n, 16), n)
    live, master = live[:n], master[:n]
    ref = master.clone()
    merge_param_writes_reference(live, ref)
    whole = torch.zeros(n + 77, device="cuda")  # the chunk at an offset, as a bucket's chunk of a shard
    got = whole[77:]
    got.copy_(master)
    live_cuda = live.cuda()
    assert fused_applies(live_cuda, got)
    merge_param_writes(live_cuda, got)
    assert torch.equal(got.cpu().view(torch.int32), ref.view(torch.int32))
    assert torch.count_nonzero(whole[:77]) == 0
