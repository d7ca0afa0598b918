"""How the parity tests compare a run with its oracle: one definition of "relative difference"."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def max_rel(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest relative difference of two equally long, non-empty series (``b`` is the reference)."""
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert ta.shape == tb.shape and len(ta) > 0, (len(a), len(b))
    return float(((ta - tb).abs() / tb.abs().clamp_min(1e-12)).max())


def tensor_rel(got: Tensor, ref: Tensor) -> float:
    """``|got - ref| / |ref|`` in the 2-norm, in float64 (``ref`` is the reference), on the CPU: a worker
    run on GPUs (``LZ_TEST_ACCELERATOR=gpu``) may record device tensors beside a CPU oracle."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))
