"""pipeline/buffers.py: receive buffers come back for the next micro-batch, unless something still sent or kept
shares their storage ([Note: reused receive buffers])."""

from __future__ import annotations

import torch

from lightning_zero.pipeline.buffers import ReceiveBuffers


def test_a_given_back_buffer_is_taken_again_cleared_of_its_gradient() -> None:
    pool = ReceiveBuffers(torch.device("cpu"))
    a = pool.take("act", (2, 3), torch.float32)
    a.requires_grad_(True)
    (a * 2).sum().backward()
    pool.give("act", [a])
    b = pool.take("act", (2, 3), torch.float32)
    assert b is a and b.grad is None and not b.requires_grad  # ready to receive into, a leaf again
    assert pool.take("act", (2, 3), torch.float32) is not a  # one buffer is handed out once
    assert pool.take("grad", (2, 3), torch.float32) is not a  # gradients and activations never mix
    assert pool.take("act", (2, 3), torch.bfloat16).dtype == torch.bfloat16
    assert pool.allocated == 4


def test_a_buffer_sharing_storage_with_what_is_sent_is_not_reused() -> None:
    """An identity layer sends its received input on; autograd may make a received gradient the input's .grad."""
    pool = ReceiveBuffers(torch.device("cpu"))
    a = pool.take("act", (4,), torch.float32)
    g = pool.take("grad", (4,), torch.float32)
    pool.give("act", [a], in_use=[a.view(2, 2)])
    pool.give("grad", [g], in_use=[g[1:]])
    assert pool.take("act", (4,), torch.float32) is not a
    assert pool.take("grad", (4,), torch.float32) is not g


def test_zero_gradients_are_shared_and_unused_shapes_released_after_training_steps() -> None:
    pool = ReceiveBuffers(torch.device("cpu"))
    like = torch.ones(3, dtype=torch.float16)
    z = pool.zeros(like)
    assert z is pool.zeros(like) and z.dtype == torch.float16 and not z.any()
    train = pool.take("act", (8,), torch.float32)
    pool.give("act", [train])
    pool.end_step(training=True)
    val = pool.take("act", (6,), torch.float32)  # a validation batch of another size
    pool.give("act", [val])
    pool.end_step(training=False)  # evaluation releases nothing: training's buffer survives it
    assert pool.take("act", (8,), torch.float32) is train
    pool.give("act", [train])
    pool.end_step(training=True)  # the validation shape was not received: released
    assert pool.take("act", (6,), torch.float32) is not val


def test_the_cached_loss_gradient_is_remade_when_written_into() -> None:
    """A loss whose custom backward scales grad_output in place must not change the next micro-batch's gradient."""
    from lightning_zero.pipeline.runtime import PipelineRuntime

    class InPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.sum()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g.mul_(3.0).expand(2)

    runtime = PipelineRuntime.__new__(PipelineRuntime)
    runtime._loss_grad = None
    grads = []
    for _ in range(2):
        x = torch.ones(2, requires_grad=True)
        loss = InPlace.apply(x)
        torch.autograd.backward(loss, runtime._loss_gradient(loss, 0.25))
        grads.append(x.grad.tolist())
    assert grads == [[0.75, 0.75], [0.75, 0.75]]
    g = runtime._loss_gradient(loss, 0.25)
    assert g is runtime._loss_gradient(loss, 0.25) and float(g) == 0.25  # reused while nothing writes into it
