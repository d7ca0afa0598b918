"""zero/grad_window.py: placeholder gradients between backward and the step (in one process; the
Trainer-level behaviour is tests/callbacks/test_callbacks_parity.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.zero.grad_window import GradientOutsideStepError, PartitionedGrad, partitioned_grads
from tests.helpers.memory import storage_bytes


def test_placeholders_allow_metadata_refuse_values_and_are_restored() -> None:
    net = nn.Linear(3, 2)
    own = torch.ones(2, 3)
    net.weight.grad = own
    names = {id(net.weight): "net.weight", id(net.bias): "net.bias"}
    with partitioned_grads([net.weight, net.bias], names):
        g = net.weight.grad
        assert isinstance(g, PartitionedGrad) and g.shape == net.weight.shape and g.dtype == net.weight.dtype
        assert net.bias.grad is not None and not g.is_meta
        assert storage_bytes([net.weight.grad, net.bias.grad]) == 4  # one shared element: memory probes still work
        assert "net.weight" in repr(g)
        with pytest.raises(GradientOutsideStepError, match="'net.bias' was used .*gradient_clip_val"):
            net.bias.grad.mul_(0.5)
        with pytest.raises(GradientOutsideStepError, match="'net.weight'"):
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        with pytest.raises(GradientOutsideStepError):
            float(net.weight.grad.norm())
    assert net.weight.grad is own and net.bias.grad is None


def test_grads_are_restored_when_the_block_raises() -> None:
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError), partitioned_grads(list(net.parameters()), {}):
        raise ValueError("hook failed")
    assert net.weight.grad is None and net.bias.grad is None
