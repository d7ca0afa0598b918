"""``lightning_zero.inference.generate`` in one process (issue #31): the KV cache through the attention hook
against recomputing the whole sequence, HF Llama against HF's own greedy ``generate`` (with and without
cache, with an eos token), sampling, a model that does not call the hook, refused input. Under ZeRO stages
on 2 ranks: tests/inference/test_predict.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.inference import HookKVCache, generate
from tests.inference.predict_runs import VOCAB, build, hf_generate


@pytest.fixture(scope="module")
def gpt() -> nn.Module:
    return build("gpt")


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return build("llama")


def prompts(batch: int = 3, length: int = 6) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(5))


def test_gpt_cache_through_the_hook_equals_recomputing(gpt: nn.Module) -> None:
    x = prompts()
    cached = generate(gpt, x, 12)
    assert cached.shape == (3, 18) and torch.equal(cached[:, :6], x)
    assert torch.equal(cached, generate(gpt, x, 12, use_cache=False))
    assert len(set(cached[:, 6:].reshape(-1).tolist())) > 3  # not one token repeated
    assert not any(hasattr(m, "_lz_sequence") for m in gpt.modules())  # the cache is gone afterwards


def test_llama_equals_hf_greedy(llama: nn.Module) -> None:
    x = prompts()
    ours = generate(llama, x, 10)
    assert torch.equal(ours, hf_generate(llama, x, 10))
    assert torch.equal(ours, hf_generate(llama, x, 10, use_cache=False))
    assert torch.equal(ours, generate(llama, x, 10, use_cache=False))


def test_llama_eos_equals_hf(llama: nn.Module) -> None:
    x = prompts()
    eos = int(generate(llama, x, 3)[0, -1])  # row 0 ends at its third token
    ours = generate(llama, x, 10, eos_token_id=eos, pad_token_id=0)
    theirs = llama.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                            eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert int(ours[0, 8]) == eos and ours[0, 9:].eq(0).all()


def test_sampling(gpt: nn.Module) -> None:
    x = prompts()

    def sample(seed: int, **kw) -> torch.Tensor:
        return generate(gpt, x, 8, do_sample=True, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(1), sample(1))
    assert torch.equal(sample(1, top_k=4), sample(1, top_k=4, use_cache=False))
    assert not torch.equal(sample(1), sample(2))
    assert torch.equal(sample(3, top_k=1), generate(gpt, x, 8))  # top-1 sampling is greedy


class OwnAttention(nn.Module):
    """Calls SDPA itself (not the hook): nothing to cache; generate recomputes the sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(idx)).split(16, dim=-1)
        return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_model_without_the_hook_recomputes() -> None:
    model = OwnAttention()
    x = prompts()
    assert torch.equal(generate(model, x, 6), generate(model, x, 6, use_cache=False))


def test_several_new_tokens_against_full_attention() -> None:
    """A forward of 3 new tokens after 5 cached ones: each sees the cache and the new ones up to itself."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    layer = nn.Module()
    with HookKVCache(layer) as cache:
        kv = getattr(layer, "_lz_sequence")
        cache.step(5)
        first = kv.attend(q[:, :, :5], k[:, :, :5], v[:, :, :5])
        cache.step(3)
        assert torch.equal(kv.positions(), torch.arange(5, 8))
        rest = kv.attend(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:])
    torch.testing.assert_close(torch.cat([first, rest], dim=2), full, atol=1e-6, rtol=1e-6)


def test_refusals(gpt: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        generate(gpt, torch.zeros(6, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="temperature"):
        generate(gpt, prompts(), 2, do_sample=True, temperature=0.0)


def test_llama_left_padded_prompts_equal_hf(llama: nn.Module) -> None:
    x = prompts(3, 7)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # row 1 is a 4-token prompt, row 2 a 6-token one, left-padded with 0
    mask[2, :1] = 0
    x = x.masked_fill(mask == 0, 0)
    theirs = llama.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(generate(llama, x, 8, attention_mask=mask), theirs)
    assert torch.equal(generate(llama, x, 8, attention_mask=mask, use_cache=False), theirs)
    # the padded row decodes as its unpadded prompt alone does
    alone = generate(llama, x[1:2, 3:], 8)
    assert torch.equal(theirs[1, 3:], alone[0])


def test_padding_refused_for_models_without_it(gpt: nn.Module) -> None:
    x = prompts()
    mask = torch.ones_like(x)
    assert torch.equal(generate(gpt, x, 3, attention_mask=mask), generate(gpt, x, 3))
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="HF causal LMs only"):
        generate(gpt, x, 3, attention_mask=mask)
