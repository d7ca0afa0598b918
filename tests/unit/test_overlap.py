"""benchmarks/overlap.py: exposed-communication interval math on synthetic device timelines (CPU only)."""

from __future__ import annotations

import random

import pytest

from benchmarks.overlap import comm_overlap, is_comm_kernel, merge, overlap_length

AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16(ncclWorkElem)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"


def test_comm_kernel_names() -> None:
    assert is_comm_kernel(AG) and is_comm_kernel(RS) and is_comm_kernel("NCCLKERNEL_x")
    assert not is_comm_kernel(GEMM) and not is_comm_kernel(ADD) and not is_comm_kernel("Memcpy DtoD (Device -> Device)")


def test_merge_joins_overlapping_and_touching_and_drops_empty() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (3, 4), (8, 8), (10, 9)]) == [(0, 4), (5, 7)]
    assert merge([]) == []


def test_overlap_length_of_two_unions() -> None:
    assert overlap_length([(0, 4), (6, 10)], [(2, 7), (9, 12)]) == pytest.approx(2 + 1 + 1)
    assert overlap_length([(0, 1)], [(1, 2)]) == 0
    assert overlap_length([], [(0, 5)]) == 0


def test_fully_hidden_communication() -> None:
    r = comm_overlap([(AG, 10, 20), (GEMM, 5, 25)], window=(0, 100))
    assert r.comm_us == 10 and r.exposed_us == 0 and r.hidden_us == 10
    assert r.exposed_fraction == 0 and r.comm_fraction == pytest.approx(0.1)


def test_fully_exposed_communication() -> None:
    r = comm_overlap([(GEMM, 0, 40), (RS, 40, 60), (ADD, 60, 80)], window=(0, 100))
    assert r.comm_us == 20 and r.exposed_us == 20
    assert r.exposed_fraction == pytest.approx(0.2) and r.comm_fraction == pytest.approx(0.2)
    assert r.busy_us == 80 and (r.n_comm, r.n_other) == (1, 2)


def test_partial_overlap_with_several_compute_kernels() -> None:
    # comm 10..50; compute covers 0..20 and 30..35 (the two GEMMs overlap each other): hidden 10 + 5.
    r = comm_overlap([(AG, 10, 50), (GEMM, 0, 15), (ADD, 12, 20), (GEMM, 30, 35)], window=(0, 200))
    assert r.comm_us == 40 and r.hidden_us == pytest.approx(15) and r.exposed_us == pytest.approx(25)
    assert r.exposed_fraction == pytest.approx(25 / 200) and r.comm_fraction == pytest.approx(40 / 200)


def test_concurrent_comm_kernels_count_once() -> None:
    # an all-gather and a reduce-scatter on two streams at once: a union, not a sum
    r = comm_overlap([(AG, 0, 30), (RS, 10, 40)], window=(0, 50))
    assert r.comm_us == 40 and r.exposed_us == 40


def test_intervals_are_clipped_to_the_window() -> None:
    r = comm_overlap([(AG, -10, 10), (RS, 90, 120), (GEMM, 95, 200)], window=(0, 100))
    assert r.comm_us == 20 and r.exposed_us == 15 and r.wall_us == 100
    outside = comm_overlap([(AG, 200, 300)], window=(0, 100))
    assert outside.n_comm == 0 and outside.comm_us == 0 and outside.exposed_fraction is None


def test_no_window_uses_activity_span() -> None:
    r = comm_overlap([(GEMM, 100, 150), (AG, 150, 200)])
    assert r.wall_us == 100 and r.exposed_fraction == pytest.approx(0.5)


def test_no_device_activity_gives_none() -> None:
    r = comm_overlap([], window=(0, 100))
    assert r.exposed_fraction is None and r.comm_fraction is None and r.comm_us == 0
    assert comm_overlap([]).wall_us == 0


def test_no_comm_kernels_is_zero_not_none() -> None:
    r = comm_overlap([(GEMM, 0, 10)], window=(0, 20))
    assert r.exposed_fraction == 0 and r.comm_fraction == 0


def test_matches_a_brute_force_grid() -> None:
    rng = random.Random(0)
    for _ in range(50):
        kernels = []
        for _ in range(rng.randint(0, 12)):
            s = rng.randint(-5, 95)
            kernels.append((rng.choice([AG, RS, GEMM, ADD]), s, s + rng.randint(0, 20)))
        r = comm_overlap(kernels, window=(0, 100))
        comm = other = exposed = 0
        for t in range(100):  # unit cells [t, t+1): integer endpoints make this exact
            c = any(is_comm_kernel(n) and s <= t < e for n, s, e in kernels)
            o = any(not is_comm_kernel(n) and s <= t < e for n, s, e in kernels)
            comm += c
            other += o
            exposed += c and not o
        assert r.comm_us == comm and r.exposed_us == exposed
        assert r.hidden_us == comm - exposed and r.as_dict()["exposed_us"] == exposed
