"""Activation checkpointing with host offload (issue #19): bitwise the losses and gradients of plain
non-reentrant checkpointing; the checkpoints (the regions' inputs) live in host copies, not in the
tensors the forward produced; the module form is in place, idempotent and reversible; the strategy
option wraps the units in one process (zero2: repeated blocks) and trains like without it."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

from lightning_zero.activations import (  # noqa: E402
    HostOffloader, apply_activation_offload, checkpoint, is_checkpointed, offloader_of, remove_checkpoint,
)

CFG = GPTConfig(vocab_size=256, n_layer=3, n_head=4, d_model=32, seq_len=16, dropout=0.1)


def _ids(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (4, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _train(model: GPT, steps: int = 4) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses (as tensors, compared bitwise) and final weights of a few AdamW steps; dropout is on,
    so the recomputation must replay the forward's random state too."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    torch.manual_seed(123)
    for step in range(steps):
        x, y = _ids(step)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _model(checkpointing: bool) -> GPT:
    torch.manual_seed(0)
    from dataclasses import replace

    return GPT(replace(CFG, activation_checkpointing=checkpointing))


def test_losses_and_weights_bitwise_equal_to_plain_non_reentrant_checkpointing() -> None:
    ref_losses, ref_weights = _train(_model(checkpointing=True))  # torch.utils.checkpoint, use_reentrant=False
    model = _model(checkpointing=False)
    shared = HostOffloader()
    for block in model.blocks:
        checkpoint(block, offload="cpu", offloader=shared)
    losses, weights = _train(model)
    assert shared.stats.packed == 4 * CFG.n_layer  # one checkpoint (the block input) per block and step
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    # and a run without any checkpointing agrees as well (dropout replayed on recompute)
    plain_losses, _ = _train(_model(checkpointing=False))
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))


def _inputs_alive_after_forward(wrap: str) -> tuple[list[bool], HostOffloader, int]:
    """Forward through four checkpointed Linear+tanh regions; weak references to each region's input:
    which of them are still alive once the forward's own references are gone."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(4)]
    offloader = HostOffloader()
    refs: list[weakref.ref] = []
    x = torch.randn(32, 64, requires_grad=True)
    h = x * 1.0
    for layer in layers:
        refs.append(weakref.ref(h))
        fn = lambda t, layer=layer: torch.tanh(layer(t))  # noqa: E731
        if wrap == "plain":
            h = torch_checkpoint(fn, h, use_reentrant=False)
        else:
            h = checkpoint(fn, offload="cpu", offloader=offloader)(h)
    out = h.sum()
    del h
    gc.collect()
    alive = [r() is not None for r in refs]
    nbytes = offloader.stats.live_bytes
    out.backward()
    return alive, offloader, nbytes


def test_saved_activations_live_in_host_copies_not_in_the_forward_tensors() -> None:
    alive_plain, _, _ = _inputs_alive_after_forward("plain")
    assert alive_plain == [True] * 4  # plain checkpointing keeps every region's input
    alive, offloader, live_during = _inputs_alive_after_forward("cpu")
    assert alive == [False] * 4  # with offload the forward's tensors are freed ...
    assert live_during == 4 * 32 * 64 * 4  # ... and their contents live in four fp32 host copies
    assert offloader.stats.peak_bytes == live_during
    gc.collect()
    assert offloader.stats.live_bytes == 0  # backward done, graph freed: the host copies are gone too


def test_module_form_in_place_idempotent_reversible_and_eval() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    names = [n for n, _ in block.named_parameters()]
    assert checkpoint(block) is block and is_checkpointed(block)
    first = offloader_of(block)
    checkpoint(block)  # no double wrapping
    assert offloader_of(block) is first and [n for n, _ in block.named_parameters()] == names
    x = torch.randn(3, 8, requires_grad=True)
    block(x).sum().backward()
    assert first is not None and first.stats.packed == 1
    with torch.no_grad():  # evaluation: nothing saved, nothing packed
        block(x)
    assert first.stats.packed == 1
    remove_checkpoint(block)
    assert not is_checkpointed(block) and "forward" not in block.__dict__
    assert offloader_of(checkpoint(nn.Linear(2, 2), offload="none")) is None  # plain checkpointing


def test_function_form_with_kwargs_and_bad_input() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    f = checkpoint(lambda a, scale=1.0: (a @ w) * scale, offload="cpu")
    a = torch.randn(2, 4, requires_grad=True)
    f(a, scale=3.0).sum().backward()
    g_ref = torch.autograd.grad(((a @ w) * 3.0).sum(), a)[0]
    assert torch.equal(a.grad, g_ref)
    with pytest.raises(ValueError, match="offload must be one of"):
        checkpoint(f, offload="nvme")
    with pytest.raises(TypeError, match="module or a function"):
        checkpoint(3)  # type: ignore[arg-type]


def test_policy_wraps_repeated_blocks_or_named_classes_once() -> None:
    model = _model(checkpointing=False)
    wrapped = apply_activation_offload(model)
    assert wrapped == list(model.blocks)  # units.py's default policy: the repeated blocks
    assert apply_activation_offload(model) == []  # setup running again wraps nothing twice
    shared = {id(offloader_of(b)) for b in model.blocks}
    assert len(shared) == 1  # one offloader: prefetch across blocks
    other = _model(checkpointing=False)
    assert apply_activation_offload(other, ["MLP"]) == [b.mlp for b in other.blocks]


def test_host_blocks_are_exact_size_and_reused_after_their_copies() -> None:
    """host_blocks.py [Note: exact-size checkpoint blocks]: a block is exactly the bytes asked (to the page; no
    power-of-two rounding), a freed block of that size is handed out again (same storage), after its events ran."""
    from lightning_zero.activations.host_blocks import HostBlocks

    class Event:
        synced = 0

        def synchronize(self) -> None:
            Event.synced += 1

    blocks = HostBlocks(pin=False)  # page-locking needs CUDA; the bookkeeping is the same
    size = (5 << 20) + 4096  # 5 MiB + one page: a power-of-two allocator would take 8 MiB
    a = blocks.take(size)
    assert a.numel() == size and blocks.capacity_bytes == size
    blocks.give_back(a, [Event(), None])
    b = blocks.take(size)
    assert b.data_ptr() == a.data_ptr() and Event.synced == 1 and blocks.capacity_bytes == size
    c = blocks.take(size)  # the only block of that size is in use: a new one
    assert c.data_ptr() != b.data_ptr() and blocks.capacity_bytes == 2 * size
    blocks.release()
    assert blocks.capacity_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_checkpoints_take_exact_pinned_blocks_reused_every_step() -> None:
    """On CUDA: checkpoints of >= 16 MiB sit in exact-size page-locked blocks (not rounded to a power of two), the
    second step reuses the first step's blocks, and gradients equal plain checkpointing bit for bit."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(1536, 1536) for _ in range(3)]).cuda()
    x = torch.randn(3000, 1536, device="cuda")  # 3000 x 1536 fp32 = 17.6 MiB a checkpoint, not a power of two
    offloader = HostOffloader()

    def run(use: bool) -> list[torch.Tensor]:
        layers.zero_grad(set_to_none=True)
        h = x
        for layer in layers:
            if use:
                with offloader.hooks():
                    h = torch_checkpoint(layer, h, use_reentrant=False)
            else:
                h = torch_checkpoint(layer, h, use_reentrant=False)
        h.square().mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    ref = run(False)
    first = run(True)
    blocks = offloader._blocks
    assert blocks is not None and blocks.capacity_bytes == 3 * 3000 * 1536 * 4
    second = run(True)
    torch.cuda.synchronize()
    assert blocks.capacity_bytes == 3 * 3000 * 1536 * 4  # reused, not grown
    for r, a, b in zip(ref, first, second):
        assert torch.equal(r, a) and torch.equal(r, b)


def test_device_fraction_keeps_the_last_modules_checkpoints_on_the_device() -> None:
    """policy.py [Note: the device share]: the last round(f * n) blocks are checkpointed without the copy out,
    the others offloaded; training is bitwise plain checkpointing's either way."""
    ref_losses, ref_weights = _train(_model(checkpointing=True))
    model = _model(checkpointing=False)  # 3 blocks: f = 0.34 keeps round(1.02) = 1 on the device
    wrapped = apply_activation_offload(model, device_fraction=0.34)
    assert wrapped == list(model.blocks) and all(is_checkpointed(b) for b in model.blocks)
    offloaders = [offloader_of(b) for b in model.blocks]
    assert offloaders[2] is None and offloaders[0] is not None and offloaders[0] is offloaders[1]
    assert apply_activation_offload(model, device_fraction=0.34) == []  # setup again: the split stays
    losses, weights = _train(model)
    assert offloaders[0].stats.packed == 4 * 2  # four steps, the two offloaded blocks' inputs only
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    every = _model(checkpointing=False)
    apply_activation_offload(every, device_fraction=1.0)
    assert all(is_checkpointed(b) and offloader_of(b) is None for b in every.blocks)


def test_the_strategy_option_splits_the_units_and_refuses_it_alone() -> None:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    class _Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(checkpointing=False)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            x, y = _ids(0)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)

    module = _Module()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=ZeroStrategy(stage=2, activation_offload=True,
                                               activation_offload_device_fraction=0.67))
    trainer.fit(module)
    blocks = list(module.model.blocks)
    assert all(is_checkpointed(b) for b in blocks)
    assert [offloader_of(b) is None for b in blocks] == [False, True, True]  # round(0.67 * 3) = 2 on the device
    assert offloader_of(blocks[0]).stats.packed == 2
    with pytest.raises(ValueError, match="activation_offload=True"):
        ZeroStrategy(activation_offload_device_fraction=0.5)
    with pytest.raises(ValueError, match="activation_offload_device_fraction"):
        ZeroStrategy(activation_offload=True, activation_offload_device_fraction=1.5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_layers_checkpointed_with_the_kv_cache_on_train_like_without_checkpointing(attn: str) -> None:
    """recompute.py [Note: no key/value cache in a recomputed region]: an HF Llama called as users call it
    (``use_cache`` left at HF's default, True), its decoder layers checkpointed: the recomputation must not
    append the layer's keys to the cache a second time. Gradients equal the run without checkpointing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def grads(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             attn_implementation=attn))
        assert model.config.use_cache
        if wrap:
            for layer in model.model.layers:
                checkpoint(layer, offload="cpu")
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    with pytest.warns(UserWarning, match="key/value cache"):
        got = grads(wrap=True)
    ref = grads(wrap=False)
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(got, ref))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_running_statistics_are_folded_in_once(momentum: float) -> None:
    """recompute.py [Note: buffers in a recomputed region]: a ResNet-style block (conv, batch norm,
    residual) checkpointed and recomputed in backward keeps the running statistics of the run without
    checkpointing, bit for bit (``num_batches_tracked`` 1 per step, not 2; ``momentum=None`` averages by it)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn(self.conv(x))) + x

    def run(wrap: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(), Block(), nn.Flatten(), nn.Linear(4 * 36, 2))
        if wrap:
            assert apply_activation_offload(net, ["Block"]) == [net[1], net[2]]
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(step))
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in net.state_dict().items()}

    ref, got = run(wrap=False), run(wrap=True)
    assert int(got["1.bn.num_batches_tracked"]) == 3
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_spectral_norm_is_recomputed_from_the_forwards_own_power_iteration() -> None:
    """recompute.py [Note: buffers in a recomputed region]: spectral norm (SN-GAN's discriminators) runs a power
    iteration in every training forward, updating its ``_u``/``_v`` buffers. Recomputed from the updated
    buffers, the weight differed from the forward's and the gradients were wrong; now they and the buffers
    equal the run without checkpointing."""
    from torch.nn.utils.parametrizations import spectral_norm

    def run(wrap: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        block = nn.Sequential(spectral_norm(nn.Linear(8, 8)), nn.Tanh(), spectral_norm(nn.Linear(8, 8)))
        if wrap:
            checkpoint(block, offload="cpu")
        for step in range(2):
            block(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        return [p.grad.clone() for p in block.parameters()], {k: v.clone() for k, v in block.state_dict().items()}

    (ref_grads, ref_state), (grads, state) = run(wrap=False), run(wrap=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_a_large_buffer_changed_in_the_forward_is_refused_naming_it() -> None:
    """A buffer above REPLAY_MAX_BYTES is not copied ahead of each forward; if the forward changes it, the
    recomputation could not start from the forward's state, so the forward refuses, naming the buffer."""

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(1 << 19))  # 2 MiB of fp32

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return self.lin(x)

    module = checkpoint(Counter(), offload="none")
    with pytest.raises(RuntimeError, match="Counter.seen .2 MiB. changed in the forward"):
        module(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        module(torch.randn(2, 4))  # evaluation recomputes nothing: allowed


def test_a_tensor_saved_several_times_is_one_host_copy_and_one_tensor_back() -> None:
    """offload.py [Note: one copy per tensor]: nn.MultiheadAttention called as ``attn(x, x, x)`` on an input that
    does not require grad (an embedding's output under a frozen embedding): one host copy serves query, key and
    value (three before), and the recomputation takes the forward's packed projection again (before, torch's
    checkpoint refused it); gradients equal the run without checkpointing. With an input requiring grad the
    recomputation is refused loudly (autograd's own wrapping), as the Note says."""

    def run(wrap: bool, grad: bool) -> tuple[list[torch.Tensor], HostOffloader]:
        torch.manual_seed(0)
        attn = nn.MultiheadAttention(8, 2, batch_first=True)
        offloader = HostOffloader()
        if wrap:
            checkpoint(attn, offload="cpu", offloader=offloader)
        x = torch.randn(2, 5, 8, requires_grad=grad)
        attn(x, x, x)[0].square().sum().backward()
        return [p.grad.clone() for p in attn.parameters()], offloader

    ref, _ = run(wrap=False, grad=False)
    got, offloader = run(wrap=True, grad=False)
    assert offloader.stats.packed == 1
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, ref))
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        run(wrap=True, grad=True)
