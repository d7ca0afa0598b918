"""Low-precision host Adam op (csrc/cpu_adam/cpu_adam_lowp*) against its pure-torch reference.

Equality is bitwise for every variant (see [Note: bitwise reference] in
lightning_zero/optim/reference_lowp.py): the int8 codes included, since they are computed on fp32
bit patterns with no table search, so there are no ties to tolerate.
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Optional

import pytest
import torch
from torch import Tensor

from lightning_zero.optim import reference_lowp as ref
from lightning_zero.optim.reference import adam_step_reference
from tests.ops.conftest import compiled

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
VARIANTS = ("bf16_sr", "bf16_kahan", "int8")
BLOCK = 256


@pytest.fixture(scope="module")
def lowp_op() -> ModuleType:
    return compiled("cpu_adam_lowp")


def _bits(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None:
        return None
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _state(variant: str, n: int, gen: torch.Generator) -> list[Optional[Tensor]]:
    """Fresh state tensors (master random, moments zero) in the op's argument order."""
    if variant == "int8":
        nb = (n + BLOCK - 1) // BLOCK
        u8 = torch.zeros(n, dtype=torch.uint8)
        return [torch.randn(n, generator=gen), u8, torch.zeros(nb), u8.clone(), torch.zeros(nb)]
    bf = torch.zeros(n, dtype=torch.bfloat16)
    comp = bf.clone() if variant == "bf16_kahan" else None
    return [torch.randn(n, generator=gen).bfloat16(), comp, bf.clone(), bf.clone()]


def _clone(state: list[Optional[Tensor]]) -> list[Optional[Tensor]]:
    return [None if t is None else t.clone() for t in state]


def _op_step(op: ModuleType, variant: str, s: list, grad: Tensor, out: Optional[Tensor], step: int, *,
             adamw: bool, grad_scale: float = 1.0, seed: int = 0, offset: int = 0, threads: int = 2,
             tier: int = -1) -> int:
    kw = dict(step=step, adamw_mode=adamw, grad_scale=grad_scale, simd_tier=tier, num_threads=threads, **HYPER)
    if variant == "int8":
        return op.adam_step_int8(s[0], grad, s[1], s[2], s[3], s[4], out, block=BLOCK, **kw)
    return op.adam_step_bf16(s[0], s[1], grad, s[2], s[3], out, seed=seed, offset=offset, **kw)


def _ref_step(variant: str, s: list, grad: Tensor, out: Optional[Tensor], step: int, *, adamw: bool,
              grad_scale: float = 1.0, seed: int = 0, offset: int = 0) -> None:
    kw = dict(step=step, adamw_mode=adamw, grad_scale=grad_scale, **HYPER)
    if variant == "int8":
        ref.adam_int8_reference(s[0], grad, s[1], s[2], s[3], s[4], out, block=BLOCK, **kw)
    else:
        ref.adam_bf16_reference(s[0], s[1], grad, s[2], s[3], out, seed=seed, offset=offset, **kw)


def _assert_same(a: list, b: list, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None:
            assert y is None
            continue
        bad = (_bits(x) != _bits(y)).sum().item()
        assert bad == 0, f"{what}: tensor {i} differs in {bad} bytes of {_bits(x).numel()}"


def _grads(n: int, dtype: torch.dtype, gen: torch.Generator, scale: float) -> Tensor:
    """Gradients over ~8 decades of magnitude (moments then span the int8 codes' whole range)."""
    mag = torch.logspace(-6, 2, n)[torch.randperm(n, generator=gen)]
    return (torch.randn(n, generator=gen) * mag * scale).to(dtype)


def _compare(op: ModuleType, variant: str, n: int, grad_dtype: torch.dtype, out_dtype: Optional[torch.dtype],
             adamw: bool, steps: int, grad_scale: float = 1.0, tier: int = -1, seed: int = 3, offset: int = 11) -> None:
    gen = torch.Generator().manual_seed(n)
    ours = _state(variant, n, gen)
    theirs = _clone(ours)
    out_a = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    out_b = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, steps + 1):
        grad = _grads(n, grad_dtype, gen, grad_scale)
        _op_step(op, variant, ours, grad, out_a, step, adamw=adamw, grad_scale=grad_scale, seed=seed, offset=offset,
                 tier=tier)  # fmt: skip
        _ref_step(variant, theirs, grad, out_b, step, adamw=adamw, grad_scale=grad_scale, seed=seed, offset=offset)
        _assert_same(ours + [out_a], theirs + [out_b], f"{variant} n={n} step {step}")
    if out_a is not None:  # the copy is the master, rounded to nearest
        assert torch.equal(_bits(out_a), _bits(ours[0].to(torch.float32).to(out_dtype)))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=["no_out", "out_bf16", "out_f16"])
def test_op_equals_reference_bitwise(lowp_op: ModuleType, variant: str, adamw: bool, grad_dtype: torch.dtype,
                                     out_dtype: Optional[torch.dtype]) -> None:
    """Every variant, grad dtype, copy dtype, Adam and AdamW, a loss scale, 6 steps: identical bits."""
    scale = 1.0 if grad_dtype == torch.float16 else 1024.0  # fp16 grads would overflow scaled
    _compare(lowp_op, variant, 1037, grad_dtype, out_dtype, adamw, steps=6, grad_scale=scale)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [1, 15, 255, 256, 257, 4099, 70_001])
def test_sizes_off_block_and_simd_widths(lowp_op: ModuleType, variant: str, n: int) -> None:
    """Lengths around the SIMD widths, the int8 block and the 64-element thread slices; 70_001 runs threaded."""
    _compare(lowp_op, variant, n, torch.bfloat16, torch.bfloat16, adamw=True, steps=3)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
def test_every_simd_tier_equals_reference(lowp_op: ModuleType, variant: str, tier: int) -> None:
    if tier > lowp_op.best_simd():
        pytest.skip(f"CPU lacks SIMD tier {tier}")
    _compare(lowp_op, variant, 4099, torch.float16, torch.float16, adamw=False, steps=4, tier=tier)
    gen = torch.Generator().manual_seed(0)
    s = _state(variant, 64, gen)
    assert _op_step(lowp_op, variant, s, torch.zeros(64), None, 1, adamw=True, tier=tier) == tier


@pytest.mark.parametrize("variant", VARIANTS)
def test_ranges_and_threads_equal_one_call(lowp_op: ModuleType, variant: str) -> None:
    """A buffer stepped as ranges (each call told its offset) or with 1 or 2 threads: the same bits as one
    call. Random bits depend on the global element index only; int8 ranges start on block boundaries."""
    n = 70_001  # > the op's threading threshold (2^15)
    cuts = [0, 256 * 3, 256 * 50, 256 * 200, n] if variant == "int8" else [0, 1, 77, 4096, 33_333, n]
    gen = torch.Generator().manual_seed(5)
    whole = _state(variant, n, gen)
    single, split = _clone(whole), _clone(whole)
    outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(3)]
    for step in range(1, 4):
        grad = _grads(n, torch.bfloat16, gen, 1.0)
        _op_step(lowp_op, variant, whole, grad, outs[0], step, adamw=True, seed=9, threads=2)
        _op_step(lowp_op, variant, single, grad, outs[1], step, adamw=True, seed=9, threads=1)
        for lo, hi in zip(cuts, cuts[1:]):
            if variant == "int8":
                b0, b1 = lo // BLOCK, (hi + BLOCK - 1) // BLOCK
                part = [split[0][lo:hi], split[1][lo:hi], split[2][b0:b1], split[3][lo:hi], split[4][b0:b1]]
            else:
                part = [None if t is None else t[lo:hi] for t in split]
            _op_step(lowp_op, variant, part, grad[lo:hi], outs[2][lo:hi], step, adamw=True, seed=9, offset=lo)
    _assert_same(whole + outs[:1], single + outs[1:2], "2 threads vs 1")
    _assert_same(whole + outs[:1], split + outs[2:], "ranges vs one call")


@pytest.mark.parametrize("variant", ["bf16_sr", "bf16_kahan"])
def test_global_indices_past_2_to_the_32(lowp_op: ModuleType, variant: str) -> None:
    """A 13B model's flat index passes 2^32: a call whose range crosses it (the op splits its chunks
    there and hoists the high word) still draws the reference's bits."""
    _compare(lowp_op, variant, 5000, torch.bfloat16, torch.bfloat16, adamw=True, steps=2, offset=2**32 - 1234)
    _compare(lowp_op, variant, 3000, torch.bfloat16, None, adamw=False, steps=2, offset=3 * 2**32 + 17)


def test_seed_step_and_offset_change_the_bits(lowp_op: ModuleType) -> None:
    n = 4096
    gen = torch.Generator().manual_seed(6)
    base = _state("bf16_sr", n, gen)
    grad = _grads(n, torch.float32, gen, 1.0)
    results = {}
    for seed, offset in [(0, 0), (1, 0), (0, 1)]:
        s = _clone(base)
        _op_step(lowp_op, "bf16_sr", s, grad, None, 1, adamw=True, seed=seed, offset=offset)
        results[(seed, offset)] = s[0].view(torch.int16)
    a, b, c = results.values()
    for other in (b, c):
        differ = (a != other).float().mean().item()
        assert 0.05 < differ < 0.95, differ  # rounded differently, yet the same update


def test_stochastic_rounding_is_unbiased() -> None:
    """Rounding x = 1 + f * 2^-7 (between bf16 neighbours 1 and 1 + 2^-7) rounds up with probability f."""
    n = 1 << 16
    h, h2 = ref.sr_bits(ref.sr_key(123, 7), 0, n)
    for f in (0.1, 0.5, 0.9):
        x = torch.full((n,), 1.0 + f * 2**-7)
        for bits in (h, h >> 16, h2):
            up = (ref.bf16_sr(x, bits).to(torch.float32) > 1.0).float().mean().item()
            assert abs(up - f) < 0.01, (f, up)  # 5 sigma of a binomial with n = 65536
        assert (ref.bf16_sr(-x, h).to(torch.float32) < -1.0).float().mean().item() == pytest.approx(f, abs=0.01)


def test_hash_emulation_matches_python_integers() -> None:
    """The int64-emulated uint32 hash (used by the reference) equals the exact Python-int version."""
    gen = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (1000,), generator=gen, dtype=torch.int64)
    xs = torch.cat([xs, torch.tensor([0, 1, 2**31, 2**32 - 1])])
    assert ref.mix32(xs).tolist() == [ref.mix32_int(x) for x in xs.tolist()]


def test_int8_codes_round_trip_and_bound_the_error() -> None:
    """Every reachable code decodes to a value that encodes back to itself; quantisation errors stay within
    half a code step: <= 1/16 relative for exp_avg, <= 1/32 for sqrt(exp_avg_sq) above the subnormal range."""
    m_codes = torch.tensor([c | s for c, s in itertools.product(range(121), (0, 0x80))], dtype=torch.uint8)
    assert torch.equal(ref.encode_m(ref.decode_m(m_codes)), m_codes)
    w_codes = torch.arange(241, dtype=torch.uint8)
    assert torch.equal(ref.encode_w(ref.decode_w(w_codes)), w_codes)
    assert ref.decode_m(torch.tensor([120], dtype=torch.uint8)).item() == 1.0
    assert ref.decode_w(torch.tensor([240], dtype=torch.uint8)).item() == 1.0
    y = torch.logspace(-12, 0, 100_000)
    rel_m = (ref.decode_m(ref.encode_m(-y)) + y).abs() / y
    rel_w = (ref.decode_w(ref.encode_w(y)) - y).abs() / y
    normal = y >= 2**-14
    assert rel_m[normal].max().item() <= 1 / 16 and rel_w[normal].max().item() <= 1 / 32
    sub = ~normal  # below 2^-14: absolute steps of 2^-18 (exp_avg_sq: 2^-17)
    assert (ref.decode_w(ref.encode_w(y[sub])) - y[sub]).abs().max().item() <= 2**-19
    assert (ref.decode_m(ref.encode_m(y[sub])) - y[sub]).abs().max().item() <= 2**-18


@pytest.mark.parametrize("variant", ["bf16_sr", "bf16_kahan"])
def test_bf16_masters_keep_updates_below_half_an_ulp(lowp_op: ModuleType, variant: str) -> None:
    """lr 1e-4 on weights of 1.0 (bf16 ulp 2^-7): every update is below half an ulp, so a master rounded
    to nearest would stay at 1.0. After 200 steps of a constant gradient both land on float64 Adam's
    ~0.98: Kahan per element (master + comp; the spread left comes from the stochastically rounded
    moments), stochastic rounding in the mean (each element is within a few bf16 ulps)."""
    n, steps = 8192, 200
    p = torch.ones(n, dtype=torch.bfloat16)
    comp = torch.zeros_like(p) if variant == "bf16_kahan" else None
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    expected = [torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    for step in range(1, steps + 1):
        lowp_op.adam_step_bf16(p, comp, torch.ones(n), m, v, None, step=step, num_threads=2, **hyper)
        adam_step_reference(expected[0], torch.ones(1, dtype=torch.float64), *expected[1:], step=step, **hyper)
    target = expected[0].item()
    assert 0.979 < target < 0.981
    value = p.to(torch.float32) + (0 if comp is None else comp.to(torch.float32))
    if variant == "bf16_kahan":
        # comp is bf16 too: each step's residual is rounded to 8 bits of comp (|comp| < 2^-8 here, so
        # by at most 2^-17), which bounds the drift by steps * 2^-17 = 1.5e-3; measured: ~1e-4
        assert (value - target).abs().max().item() < 200 * 2**-17
        assert abs(value.mean().item() - target) < 5e-4
    else:
        assert abs(value.mean().item() - target) < 1e-4
        assert (value - target).abs().max().item() < 8 * 2**-7
