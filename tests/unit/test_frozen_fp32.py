"""lightning_zero/frozen_fp32.py on one process: the shares it takes and what it gives back (its collective path,
2 ranks, runs in tests/distributed/test_after_fit.py)."""

from __future__ import annotations

import gc

import torch

from lightning_zero.frozen_fp32 import FrozenFp32, even_range


def _one(p: torch.Tensor) -> tuple[int, int, None]:
    return 0, 1, None


def _second_of_three(p: torch.Tensor) -> tuple[int, int, None]:
    return 1, 3, None


def test_a_share_is_the_even_range_checkpoints_write_and_full_is_exact() -> None:
    w = torch.nn.Parameter(torch.randn(7, 5), requires_grad=False)
    kept = FrozenFp32.capture([w], _second_of_three)
    start, values = kept.piece(w)
    lo, hi = even_range(35, 1, 3)
    assert (start, values.numel()) == (lo, hi - lo) == (11, 12)
    assert torch.equal(values, w.detach().reshape(-1)[lo:hi]) and values.device.type == "cpu"
    whole = FrozenFp32.capture([w], _one)
    exact = w.detach().clone()
    w.data = w.data.to(torch.bfloat16)  # the cast layout's copy
    assert not torch.equal(w.float(), exact)  # the cast did round
    assert torch.equal(whole.full(w, torch.device("cpu")), exact)  # the share did not


def test_what_is_not_taken_and_what_a_second_capture_keeps() -> None:
    fp32 = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    bf16 = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16), requires_grad=False)
    meta = torch.nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    ints = torch.nn.Parameter(torch.arange(4), requires_grad=False)
    first = FrozenFp32.capture([fp32, bf16, meta, ints, fp32], _one)
    assert first.holds(fp32) and not any(first.holds(t) for t in (bf16, meta, ints)) and len(first) == 1
    exact = fp32.detach().clone()
    fp32.data = fp32.data.to(torch.bfloat16)  # a module that kept its 16-bit copy after fit
    second = FrozenFp32.capture([fp32], _one, previous=first)
    assert torch.equal(second.full(fp32, torch.device("cpu")), exact)  # the share taken before the cast


def test_set_full_and_a_reused_id_does_not_match() -> None:
    w = torch.nn.Parameter(torch.randn(3, 3), requires_grad=False)
    kept = FrozenFp32.capture([w], _one)
    loaded = torch.randn(3, 3, dtype=torch.float64)
    kept.set_full(w, loaded)
    assert torch.equal(kept.full(w, torch.device("cpu")), loaded.float())
    key = id(w)
    del w
    gc.collect()
    others = [torch.nn.Parameter(torch.zeros(3, 3)) for _ in range(64)]  # may reuse the freed id
    assert not any(kept.holds(o) for o in others)  # a share knows its parameter, not just its id
    assert kept.shares[key].param() is None
