"""Count what is handed to torch.distributed, by wrapping its collectives (not from any report of ours).

``handed`` is the size of the tensors passed in; ``wire`` is what this rank sends under a
bandwidth-optimal algorithm (NCCL's rings): all-reduce 2(N-1)/N x bytes, all-to-all and
reduce-scatter (N-1)/N x input bytes, all-gather (N-1) x input bytes, send/broadcast the bytes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass
class Counter:
    calls: list[tuple[str, int]] = field(default_factory=list)
    wire: float = 0.0
    handed: int = 0


# op name -> (index of the input tensor argument, wire factor as a function of N)
_RULES: dict[str, tuple[int, Callable[[int], float]]] = {
    "all_reduce": (0, lambda n: 2.0 * (n - 1) / n),
    "all_to_all_single": (1, lambda n: (n - 1) / n),
    "reduce_scatter_tensor": (1, lambda n: (n - 1) / n),
    "reduce_scatter_single": (1, lambda n: (n - 1) / n),  # torch's current name (collectives.py)
    "all_gather_into_tensor": (1, lambda n: float(n - 1)),
    "all_gather_single": (1, lambda n: float(n - 1)),
    "all_gather": (1, lambda n: float(n - 1)),
    "broadcast": (0, lambda n: 1.0),
    "send": (0, lambda n: 1.0),
    "recv": (0, lambda n: 0.0),
}


@contextmanager
def count_collectives() -> Iterator[Counter]:
    counter = Counter()
    originals: dict[tuple[Any, str], Callable] = {}
    world = dist.get_world_size()

    def wrap(name: str, fn: Callable, arg: int, factor: Callable[[int], float]) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t = args[arg] if len(args) > arg else next(iter(kwargs.values()), None)
            nbytes = _nbytes(t)
            counter.calls.append((name, nbytes))
            counter.handed += nbytes
            counter.wire += factor(world) * nbytes
            return fn(*args, **kwargs)

        return wrapped

    for name, (arg, factor) in _RULES.items():
        if not hasattr(c10d, name):  # a name this torch does not have (yet, or any more)
            continue
        fn = getattr(c10d, name)
        for module in (dist, c10d):
            originals[(module, name)] = getattr(module, name)
            setattr(module, name, wrap(name, fn, arg, factor))
    try:
        yield counter
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
