"""Pure split math: which contiguous slice of the layer list each pipeline stage holds.

A split is a list of ``parts + 1`` boundaries: part ``p`` holds layers ``bounds[p]:bounds[p + 1]``.
Every part holds at least one layer. Methods (DeepSpeed's names, which its users know):

- ``"parameters"`` (default): balanced by parameter count, minimising the largest part;
- ``"uniform"``: balanced by layer count;
- ``"type:<regex>"``: balanced by the number of layers whose class name matches the pattern
  (``"type:Block"`` puts the same number of transformer blocks on every stage);
- an explicit list of boundaries, e.g. ``[0, 3, 8]``.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence, Union

PartitionMethod = Union[str, Sequence[int]]


def _check(num_layers: int, parts: int) -> None:
    if parts < 1:
        raise ValueError(f"the number of pipeline parts must be >= 1, got {parts}.")
    if num_layers < parts:
        raise ValueError(
            f"the model has {num_layers} layer(s) but the pipeline has {parts} stage(s): every stage needs at "
            "least one layer. Use fewer pipeline stages or split the model into more layers."
        )


def uniform(num_layers: int, parts: int) -> list[int]:
    """Equal layer counts; the first ``num_layers % parts`` parts get one more."""
    _check(num_layers, parts)
    base, extra = divmod(num_layers, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def _min_bottleneck(n: int, parts: int, cost: Callable[[int, int], float]) -> tuple[float, list[int]]:
    """Exact dynamic programme: contiguous split of ``n`` items into ``parts`` minimising the largest
    ``cost(j, i)`` of a part ``j:i`` (infinite cost = forbidden part)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i items in k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                c = max(best[k - 1][j], cost(j, i))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return best[parts][n], bounds[::-1]


def balanced(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split minimising the heaviest part; among the optimal ones, the most even layer counts."""
    n = len(weights)
    _check(n, parts)
    prefix = [0.0]
    for w in weights:
        if w < 0:
            raise ValueError(f"layer weights must be >= 0, got {w}.")
        prefix.append(prefix[-1] + float(w))
    heaviest, _ = _min_bottleneck(n, parts, lambda j, i: prefix[i] - prefix[j])
    slack = heaviest * 1e-9 + 1e-12
    _, bounds = _min_bottleneck(
        n, parts, lambda j, i: float(i - j) if prefix[i] - prefix[j] <= heaviest + slack else float("inf")
    )
    return bounds


def by_pattern(names: Sequence[str], pattern: str, parts: int) -> list[int]:
    """Balance the count of layers whose name matches ``pattern`` (a case-insensitive regex)."""
    regex = re.compile(pattern, re.IGNORECASE)
    weights = [1.0 if regex.search(name) else 0.0 for name in names]
    matched = int(sum(weights))
    if matched < parts:
        raise ValueError(
            f"partition pattern {pattern!r} matches {matched} layer(s) ({[n for n, w in zip(names, weights) if w]}) "
            f"but the pipeline has {parts} stage(s): each stage needs at least one matching layer."
        )
    return balanced(weights, parts)


def explicit(bounds: Sequence[int], num_layers: int, parts: int) -> list[int]:
    """Validate user-given boundaries."""
    b = [int(x) for x in bounds]
    if len(b) != parts + 1 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(
            f"partition boundaries {b} must be strictly increasing, start at 0, end at {num_layers} (the layer "
            f"count) and have {parts + 1} entries for {parts} stage(s)."
        )
    return b


def split(
    method: PartitionMethod,
    num_layers: int,
    parts: int,
    weights: Callable[[], Sequence[float]],
    names: Callable[[], Sequence[str]],
) -> list[int]:
    """Boundaries for ``method``; ``weights``/``names`` are called only by the methods that need them
    (counting parameters may build the layers on the meta device)."""
    _check(num_layers, parts)
    if parts == 1:  # un-pipelined: whatever the method (explicit boundaries name a pipelined split)
        return [0, num_layers]
    if not isinstance(method, str):
        return explicit(method, num_layers, parts)
    if method == "parameters":
        return balanced(weights(), parts)
    if method == "uniform":
        return uniform(num_layers, parts)
    if method.startswith("type:"):
        return by_pattern(names(), method[len("type:"):], parts)
    raise ValueError(
        f"partition must be 'parameters', 'uniform', 'type:<regex>' or a list of boundaries, got {method!r}."
    )


__all__ = ["PartitionMethod", "uniform", "balanced", "by_pattern", "explicit", "split"]
