"""The long-sequence memory pieces (issue #30 item 4) against the plain computation: the chunked
cross-entropy against ``F.cross_entropy`` on the full logits, the tiled MLP against the untiled one (an HF
Llama MLP and a nanoGPT-style MLP), and their memory effect counted by the storage autograd saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.sequence.chunked_loss import chunked_cross_entropy
from lightning_zero.sequence.tiled_mlp import tile, tile_mlps
from tests.helpers.compare import tensor_rel


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn`` runs (the activation
    memory a training step keeps), counted through saved-tensor hooks."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_equals_full_logits(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, :5] = -100
    ref = F.cross_entropy(F.linear(hidden, weight, b).reshape(-1, 50), labels.reshape(-1), reduction="sum")
    ref_grads = torch.autograd.grad(ref, [hidden, weight] + ([b] if bias else []))
    got = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8)
    grads = torch.autograd.grad(got, [hidden, weight] + ([b] if bias else []))
    assert abs(float(got.detach()) - float(ref.detach())) / float(ref.detach()) < 1e-6
    for a, r in zip(grads, ref_grads):
        assert tensor_rel(a, r) < 1e-5


def test_chunked_loss_under_autocast_runs_its_gemms_as_an_autocast_head_does() -> None:
    """fp32 weights, bf16 autocast (ddp's bf16-mixed): the chunked loss's gradients are those of a plain
    ``F.linear`` head under the same autocast (bf16 GEMMs), and the backward runs with fp32 weights beside
    bf16 hidden states (its recomputed logits used to mix the two dtypes and fail)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(40, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (64,), generator=g)
    labels[:7] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
        got = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    grads = torch.autograd.grad(got, [hidden, weight])
    assert abs(float(got.detach()) - float(ref.detach())) / float(ref.detach()) < 1e-3
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    for a, r in zip(grads, ref_grads):
        assert tensor_rel(a.float(), r.float()) < 2e-2  # bf16 GEMMs on both sides, summed in other orders
    assert grads[0][:7].abs().max() == 0  # ignored tokens get no gradient


def test_chunked_loss_keeps_no_logits() -> None:
    hidden = torch.randn(512, 32, requires_grad=True)
    weight = torch.randn(1000, 32, requires_grad=True)
    labels = torch.randint(0, 1000, (512,))
    full, _ = _saved_bytes(lambda: F.cross_entropy(F.linear(hidden, weight), labels, reduction="sum"))
    chunked, _ = _saved_bytes(lambda: chunked_cross_entropy(hidden, weight, labels, chunk_tokens=64))
    logits_bytes = 512 * 1000 * 4
    assert full >= logits_bytes  # the plain loss keeps the [tokens, vocab] logits (or their softmax)
    assert chunked < logits_bytes / 4  # inputs only: hidden, weight, labels


class NanoMLP(nn.Module):
    """nanoGPT's MLP as its repository writes it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


def _llama_mlp() -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=96))


@pytest.mark.parametrize("make", [lambda: NanoMLP(32), _llama_mlp], ids=["nanogpt", "llama"])
def test_tiled_mlp_equals_untiled_and_keeps_less(make) -> None:
    torch.manual_seed(0)
    plain = make()
    tiled = make()
    tiled.load_state_dict(plain.state_dict())
    tile(tiled, 4)
    assert list(tiled.state_dict()) == list(plain.state_dict())  # names and checkpoints unchanged
    x = torch.randn(2, 64, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    plain_bytes, y = _saved_bytes(lambda: plain(x))
    tiled_bytes, y2 = _saved_bytes(lambda: tiled(x2))
    assert tensor_rel(y2, y) < 1e-6
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    assert tensor_rel(x2.grad, x.grad) < 1e-6
    for (n, p), q in zip(plain.named_parameters(), tiled.parameters()):
        assert tensor_rel(q.grad, p.grad) < 1e-5, n
    assert tiled_bytes * 2 < plain_bytes  # only the tiles' inputs are kept, not the 4x intermediates


def test_tile_mlps_finds_the_blocks_mlps() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2))
    keys = list(model.state_dict())
    assert tile_mlps(model, 2) == 3
    assert list(model.state_dict()) == keys


def test_tiled_mlp_without_sequence_parallel_is_applied_not_ignored() -> None:
    """``tiled_mlp`` is a memory switch of its own: with ``sequence_parallel=1`` the strategy tiles the MLPs (it once
    did nothing there, silently), trains as the untiled model does, and refuses a model with no ``mlp``."""
    import copy

    from lightning.fabric import Fabric

    import lightning_zero
    from lightning_zero.sequence.tiled_mlp import TILED
    from tests.zoo.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, block_size=16))
    plain = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 16))
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true",
                    strategy=lightning_zero.ZeroFabricStrategy(stage=2, tiled_mlp=4))
    fabric.launch()
    tiled = fabric.setup_module(model)
    mlps = [b.mlp for b in model.transformer.h]
    assert [getattr(m, TILED, None) for m in mlps] == [4, 4]
    loss = tiled(idx, idx)[1]
    fabric.backward(loss)
    ref = plain(idx, idx)[1]
    ref.backward()
    assert torch.equal(loss.detach(), ref.detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and tensor_rel(p.grad, q.grad) < 1e-6, name
    from lightning_zero.config import SequenceConfig
    from lightning_zero.sequence.apply import tile_module_mlps

    with pytest.raises(ValueError, match="tiled_mlp=2: Sequential has no submodule named 'mlp'"):
        tile_module_mlps(nn.Sequential(nn.Linear(4, 4)), SequenceConfig(tiled_mlp=2))
