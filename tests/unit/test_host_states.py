"""HostAdamState (lightning_zero/optim/host_states.py): storage per precision, the allocator, views,
fp32 export/import, the step front and its fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.ops import OpFallbackWarning, registry
from lightning_zero.ops.cpu_adam_lowp import CPUAdamLowpBuilder
from lightning_zero.optim.host_states import (
    INT8_BLOCK,
    PRECISIONS,
    HostAdamState,
    bytes_per_param,
    load_host_op,
    step,
)

HYPER = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)


class CountingAlloc:
    """Hands out tensors like the engine's pinned pool would, and remembers every one."""

    def __init__(self) -> None:
        self.handed: list[Tensor] = []

    def __call__(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = torch.full((numel,), 7, dtype=dtype)  # garbage: zeros() must clear it
        self.handed.append(t)
        return t


def _storage_bytes(tensors: list[Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n", [1, 1000, INT8_BLOCK * 40, 100_003])
def test_storage_bytes_match_bytes_per_param(precision: str, n: int) -> None:
    alloc = CountingAlloc()
    state = HostAdamState.zeros(n, precision, alloc)
    counted = _storage_bytes(state.tensors())
    assert counted == _storage_bytes(alloc.handed), "every state tensor comes from alloc, and nothing else"
    assert {t.untyped_storage().data_ptr() for t in state.tensors()} == {t.untyped_storage().data_ptr() for t in alloc.handed}
    exact = bytes_per_param(precision) * n
    if precision == "int8" and n % INT8_BLOCK:
        assert exact < counted <= exact + 8  # one partial block's two scales
    else:
        assert counted == exact
    assert all(bool((t == 0).all()) for t in state.tensors())
    assert {"fp32": 12, "bf16_sr": 6, "bf16_kahan": 8, "int8": 6}[precision] <= bytes_per_param(precision) < 12.1


def _fields(state: HostAdamState) -> dict[str, Tensor]:
    names = ("master", "exp_avg", "exp_avg_sq", "comp", "exp_avg_scale", "exp_avg_sq_scale")
    return {k: getattr(state, k) for k in names if getattr(state, k) is not None}


@pytest.mark.parametrize("precision,with_master16", [(p, False) for p in PRECISIONS] + [("bf16_sr", True), ("bf16_kahan", True)])
@pytest.mark.parametrize("n", [1, 2 * (1 << 20) + 777])  # one element; and three import chunks (in-place overlap)
def test_adopt_is_zeros_plus_import_built_in_the_masters_memory(precision: str, with_master16: bool, n: int) -> None:
    """The state built in the fp32 master's memory equals zeros() + import_fp32() bit for bit, and
    allocates only what the layout needs beyond that memory (the construction peak of the engine).
    ``master16`` (the 16-bit parameter partition as master) exists for the bf16 layouts only."""
    master = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 3
    want = HostAdamState.zeros(n, precision, seed=2)
    want.import_fp32(master)
    buffer = master.clone()
    master16 = torch.full((n,), 5.0, dtype=torch.bfloat16) if with_master16 else None
    alloc = CountingAlloc()
    got = HostAdamState.adopt(buffer, precision, alloc, master16=master16, seed=2)
    assert _fields(got).keys() == _fields(want).keys() and got.seed == want.seed
    for k, t in _fields(got).items():
        assert t.dtype == _fields(want)[k].dtype and torch.equal(t, _fields(want)[k]), k
    fp32_buffer = buffer.untyped_storage().data_ptr()
    inside = {k for k, t in _fields(got).items() if t.untyped_storage().data_ptr() == fp32_buffer}
    if precision in ("fp32", "int8"):
        assert inside == {"master"}
    else:
        assert inside == ({"exp_avg", "exp_avg_sq"} if with_master16 else {"master", "exp_avg"})
    if with_master16:
        assert got.master.data_ptr() == master16.data_ptr()
    extra = _storage_bytes(alloc.handed)
    state_bytes = bytes_per_param(precision) * n
    expect = state_bytes - 4 * n - (2 * n if with_master16 else 0)
    assert expect <= extra <= expect + 8, (extra, expect)  # int8: one partial block's two scales


def test_adopt_refuses_what_it_cannot_build_in_place() -> None:
    with pytest.raises(ValueError, match="contiguous 1-D fp32 master"):
        HostAdamState.adopt(torch.zeros(8, dtype=torch.bfloat16), "bf16_sr")
    with pytest.raises(ValueError, match="contiguous 1-D fp32 master"):
        HostAdamState.adopt(torch.zeros(8, 2)[:, 0], "int8")
    with pytest.raises(ValueError, match="master16 must be a contiguous bf16 tensor of 8"):
        HostAdamState.adopt(torch.zeros(8), "bf16_sr", master16=torch.zeros(8, dtype=torch.float16))


def _trained(precision: str, n: int = 3000, steps: int = 4) -> HostAdamState:
    gen = torch.Generator().manual_seed(1)
    state = HostAdamState.zeros(n, precision, seed=5)
    state.import_fp32(torch.randn(n, generator=gen))
    op = load_host_op(precision)
    for k in range(1, steps + 1):
        step(op, state, torch.randn(n, generator=gen).bfloat16(), None, k, HYPER, threads=2)
    return state


@pytest.mark.parametrize("precision", PRECISIONS)
def test_export_import_round_trip(precision: str) -> None:
    """Checkpoints store torch's fp32 layout: exporting, importing into a fresh state and exporting again
    gives the same fp32 tensors, and for every layout but Kahan's the same state bits (Kahan's
    master/comp split may move by a rounding tie; their sum, what is exported, does not)."""
    state = _trained(precision)
    exported = state.export_fp32()
    assert all(t.dtype == torch.float32 and t.numel() == state.numel for t in exported)
    assert bool((exported[2] >= 0).all()) and exported[1].abs().sum() > 0
    fresh = HostAdamState.zeros(state.numel, precision)
    fresh.import_fp32(*exported)
    for a, b in zip(exported, fresh.export_fp32()):
        assert torch.equal(a, b)
    if precision != "bf16_kahan":
        for a, b in zip(state.tensors(), fresh.tensors()):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_checkpoints_cross_precisions() -> None:
    """A state written under fp32 resumes under each compact layout within that layout's rounding."""
    exported = _trained("fp32").export_fp32()
    m_scale = exported[1].abs().max().item()
    for precision in PRECISIONS:
        state = HostAdamState.zeros(exported[0].numel(), precision)
        state.import_fp32(*exported)
        master, exp_avg, exp_avg_sq = state.export_fp32()
        master_tol = {"fp32": 0, "bf16_sr": 2**-8, "bf16_kahan": 2**-16, "int8": 0}[precision]
        assert ((master - exported[0]).abs() <= master_tol * exported[0].abs()).all(), precision
        if precision == "int8":  # within half a code step of its block's scale (<= 1/16 relative)
            assert (exp_avg - exported[1]).abs().max().item() <= m_scale / 16
            assert ((exp_avg_sq.sqrt() - exported[2].sqrt()).abs() <= exported[2].sqrt().max() / 32).all()
        else:
            tol = 0 if precision == "fp32" else 2**-8
            assert ((exp_avg - exported[1]).abs() <= tol * exported[1].abs()).all(), precision


def test_import_master_only_zeroes_the_moments() -> None:
    for precision in PRECISIONS:
        state = _trained(precision, n=600)
        master = torch.randn(600)
        state.import_fp32(master)
        got = state.export_fp32()
        assert got[1].abs().sum() == 0 and got[2].abs().sum() == 0
        assert torch.allclose(got[0], master, rtol=2**-8 if precision == "bf16_sr" else 2**-16, atol=0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_narrowed_steps_equal_a_whole_step(precision: str) -> None:
    """Steps over views (the engine's chunks), each given the root's offset, update the root exactly as one
    step: the views share storage, and the random bits follow offset + base + i."""
    n, offset = 5000, 123_456
    whole, parts = _trained(precision, n), _trained(precision, n)
    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(n, generator=gen).bfloat16()
    out_a, out_b = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    op = load_host_op(precision)
    step(op, whole, grad, out_a, 5, HYPER, threads=2, offset=offset)
    cuts = [0, INT8_BLOCK, INT8_BLOCK * 7, n]
    for lo, hi in zip(cuts, cuts[1:]):
        view = parts.narrow(lo, hi)
        assert view.base == lo and view.master_view().data_ptr() == parts.master[lo:].data_ptr()
        step(op, view, grad[lo:hi], out_b[lo:hi], 5, HYPER, threads=1, offset=offset)
    for a, b in zip(whole.tensors(), parts.tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(out_a, out_b)
    nested = parts.narrow(INT8_BLOCK, n).narrow(INT8_BLOCK, 2 * INT8_BLOCK)
    assert nested.base == 2 * INT8_BLOCK and nested.numel == INT8_BLOCK


@pytest.mark.parametrize("precision", ["bf16_sr", "bf16_kahan", "int8"])
def test_reference_fallback_is_bitwise_the_op(precision: str) -> None:
    a, b = _trained(precision), _trained(precision)
    op = load_host_op(precision)
    assert op is not None, "cpu_adam_lowp must build on CI machines"
    gen = torch.Generator().manual_seed(3)
    for k in range(5, 8):
        grad = torch.randn(a.numel, generator=gen).half()
        out_a, out_b = torch.empty(a.numel, dtype=torch.float16), torch.empty(a.numel, dtype=torch.float16)
        step(op, a, grad, out_a, k, HYPER, grad_scale=2.0, threads=2, offset=77)
        step(None, b, grad, out_b, k, HYPER, grad_scale=2.0, offset=77)
        assert torch.equal(out_a, out_b)
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_fp32_precision_is_todays_op_and_its_fallback() -> None:
    """"fp32" runs the existing cpu_adam op (bit for bit) or, without it, torch's fused Adam (fp32-close)."""
    a, b, c = (HostAdamState.zeros(777, "fp32") for _ in range(3))
    for s in (a, b, c):
        s.import_fp32(torch.linspace(-1, 1, 777))
    op = load_host_op("fp32")
    m, v = torch.zeros(777), torch.zeros(777)
    p = torch.linspace(-1, 1, 777)
    for k in range(1, 4):
        g = torch.sin(torch.arange(777.0) * k)
        step(op, a, g, None, k, HYPER, threads=2)
        step(None, c, g, None, k, HYPER)
        op.adam_step(p, g, m, v, None, lr=HYPER.lr, beta1=HYPER.beta1, beta2=HYPER.beta2, eps=HYPER.eps,
                     weight_decay=HYPER.weight_decay, adamw_mode=True, step=k)  # fmt: skip
    assert torch.equal(a.master, p) and torch.equal(a.exp_avg, m) and torch.equal(a.exp_avg_sq, v)
    torch.testing.assert_close(c.master, p, rtol=1e-6, atol=1e-6)


def test_unavailable_op_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setenv("LIGHTNING_ZERO_BUILD_DIR", str(tmp_path))
    monkeypatch.setitem(registry.OPS, "cpu_adam_lowp", CPUAdamLowpBuilder())  # a fresh, unloaded cache
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = [load_host_op(p) for p in ("bf16_sr", "bf16_kahan", "int8")]
    assert ops == [None, None, None]
    fallback = [w for w in caught if issubclass(w.category, OpFallbackWarning)]
    assert len(fallback) == 1 and "cpu_adam_lowp" in str(fallback[0].message)
    state = HostAdamState.zeros(300, "int8")
    step(None, state, torch.ones(300), None, 1, HYPER)
    assert state.master.abs().sum() > 0 and state.exp_avg_scale is not None and (state.exp_avg_scale > 0).all()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        HostAdamState.zeros(10, "fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block"):
        HostAdamState.zeros(1000, "int8").narrow(100, 600)
    with pytest.raises(ValueError, match="block"):
        HostAdamState.zeros(1000, "int8").narrow(0, 300)
    HostAdamState.zeros(1000, "int8").narrow(256, 1000)  # to the end is fine
    with pytest.raises(ValueError, match="outside"):
        HostAdamState.zeros(10, "bf16_sr").narrow(5, 11)
    state = HostAdamState.zeros(10, "bf16_sr")
    with pytest.raises(ValueError, match="elements"):
        step(None, state, torch.zeros(9), None, 1, HYPER)
    with pytest.raises(TypeError, match="load_host_op"):
        step(load_host_op("fp32"), state, torch.zeros(10), None, 1, HYPER)
    with pytest.raises(ValueError, match="returned"):
        HostAdamState.zeros(10, "fp32", lambda n, d: torch.empty(n, dtype=torch.float64))
