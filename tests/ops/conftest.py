"""Shared fixtures of the op tests: compiled modules (built once per session) and tolerances."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from lightning_zero.ops import get_op

FP32_EPS = torch.finfo(torch.float32).eps


def compiled(name: str) -> ModuleType:
    """Load op ``name``; skip only if this machine cannot build it (a failed build fails the test)."""
    op = get_op(name)
    ok, why = op.is_compatible()
    if not ok:
        pytest.skip(f"{name}: {why}")
    return op.load()


@pytest.fixture(scope="session")
def cpu_adam_op() -> ModuleType:
    return compiled("cpu_adam")


@pytest.fixture(scope="session")
def sign_pack_cpu_op() -> ModuleType:
    return compiled("sign_pack_cpu")


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, steps: int, what: str = "") -> None:
    """``actual`` (fp32 kernel) is within fp32 rounding of ``expected`` (float64 reference) after ``steps``.

    Rounding errors of an fp32 recurrence grow at most linearly with the number
    of steps; the bound allows 2 ulps of the largest magnitude per step, which
    torch's own fp32 Adam also stays within (checked in test_cpu_adam).
    """
    diff = (actual.double() - expected.double()).abs().max().item()
    bound = 2 * steps * FP32_EPS * max(expected.abs().max().item(), 1e-3)
    assert diff <= bound, f"{what}: max error {diff:.3e} > {bound:.3e} after {steps} steps"
