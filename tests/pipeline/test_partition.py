"""Split math: uniform, balanced by weight (checked against brute force), by pattern, explicit."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_zero.pipeline import partition as P


def _parts(bounds: list[int], weights: list[float]) -> list[float]:
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def _brute_force_best(weights: list[float], parts: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(_parts(bounds, weights)))
    return best


def test_uniform() -> None:
    assert P.uniform(7, 2) == [0, 4, 7]
    assert P.uniform(8, 4) == [0, 2, 4, 6, 8]
    assert P.uniform(3, 3) == [0, 1, 2, 3]


def test_balanced_is_optimal_and_contiguous() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        weights = [rng.choice([0, 1, 5, 100, rng.random() * 50]) for _ in range(n)]
        bounds = P.balanced(weights, parts)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == parts + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:]))  # every part holds a layer
        assert max(_parts(bounds, weights)) == pytest.approx(_brute_force_best(weights, parts))


def test_balanced_by_parameters_for_a_transformer() -> None:
    # embedding, 4 equal blocks, final norm, tied head: the blocks split 2 / 2
    weights = [888, 3600, 3600, 3600, 3600, 48, 888]
    assert P.balanced(weights, 2) == [0, 3, 7]


def test_by_pattern_balances_matching_layers() -> None:
    names = ["Embedding", "Block", "Block", "Block", "Block", "Block", "Block", "LayerNorm", "Embedding"]
    bounds = P.by_pattern(names, "block", 3)
    counts = [sum(n == "Block" for n in names[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert counts == [2, 2, 2]
    with pytest.raises(ValueError, match="matches 0 layer"):
        P.by_pattern(names, "attention", 2)


def test_explicit_bounds() -> None:
    assert P.explicit([0, 3, 8], 8, 2) == [0, 3, 8]
    for bad in ([0, 3], [1, 3, 8], [0, 3, 3, 8], [0, 9]):
        with pytest.raises(ValueError, match="strictly increasing"):
            P.explicit(bad, 8, len(bad) - 1 if len(bad) != 2 else 2)


def test_more_parts_than_layers_is_a_clear_error() -> None:
    for method in ("uniform", "parameters"):
        with pytest.raises(ValueError, match="3 layer\\(s\\) but the pipeline has 4 stage\\(s\\)"):
            P.split(method, 3, 4, lambda: [1, 1, 1], lambda: ["a", "b", "c"])


def test_unknown_method() -> None:
    with pytest.raises(ValueError, match="'parameters', 'uniform', 'type:<regex>'"):
        P.split("random", 4, 2, lambda: [1] * 4, lambda: ["a"] * 4)


def test_split_calls_only_what_it_needs() -> None:
    def boom() -> list:
        raise AssertionError("not needed")

    assert P.split("uniform", 4, 2, boom, boom) == [0, 2, 4]
    assert P.split("type:x", 4, 2, boom, lambda: ["x", "y", "x", "y"]) == [0, 2, 4]  # even layer counts on ties


def test_one_part_ignores_the_method() -> None:
    """The same module runs un-pipelined whatever its partition (explicit boundaries included)."""
    assert P.split([0, 3, 8], 8, 1, lambda: [1] * 8, lambda: ["a"] * 8) == [0, 8]
    assert P.split("type:nothing", 8, 1, lambda: [1] * 8, lambda: ["a"] * 8) == [0, 8]
