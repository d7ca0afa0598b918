"""``generate(..., compile=...)`` (issue #31; lightning_zero/inference/compiled.py, static_cache.py): the static
cache and the compiled one-token step give the tokens of the uncompiled path, on HF Llama (equal to HF's greedy
``generate`` too) and on our GPT through the hook; one traced graph with no graph break, reused across calls of
other lengths; eos cut where the uncompiled loop stops although the loop checks only every few tokens; sampling
from the same generator; a quantized model; the refusals. Inductor compiles once here (our GPT: the cheap one);
the other cases trace with the ``eager`` backend (the same graph, no code generated). CUDA graphs: GPU-marked at
the end (``python -m pytest tests/inference -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from lightning_zero.config.decode import DecodeConfig
from lightning_zero.inference import generate, quantize_linears
from lightning_zero.inference.compiled import CompiledDecoder
from tests.inference.predict_runs import build, hf_generate
from tests.inference.test_generate import OwnAttention, gpt, llama, prompts  # noqa: F401 - fixtures shared

TRACE = DecodeConfig(backend="eager", fullgraph=True)


def test_gpt_inductor_equals_uncompiled_and_compiles_once(gpt: nn.Module) -> None:
    x = prompts()
    counters.clear()
    ours = generate(gpt, x, 10, compile=True)  # CPU: mode "default" ([Note: CUDA graphs only on CUDA])
    assert torch.equal(ours, generate(gpt, x, 10))
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 20
    assert not counters["graph_break"]
    longer = generate(gpt, x, 14, compile=True)  # same cache (rounded to 64), same graph
    assert torch.equal(longer, generate(gpt, x, 14))
    assert counters["stats"]["unique_graphs"] == 1
    assert not any(hasattr(m, "_lz_sequence") for m in gpt.modules())  # the static cache is detached


def test_llama_equals_hf_greedy(llama: nn.Module) -> None:
    x = prompts()
    counters.clear()
    ours = generate(llama, x, 10, compile=TRACE)
    assert torch.equal(ours, hf_generate(llama, x, 10))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # fullgraph: no break
    decoder = llama.__dict__["_lz_compiled_decoder"]
    assert isinstance(decoder, CompiledDecoder)
    assert torch.equal(generate(llama, x[:, :4], 5, compile=TRACE), hf_generate(llama, x[:, :4], 5))
    assert llama.__dict__["_lz_compiled_decoder"] is decoder and counters["stats"]["unique_graphs"] == 1
    one = generate(llama, x[:1], 70, compile=TRACE)  # past the first cache's 64 tokens: a new cache, a new trace
    assert torch.equal(one, hf_generate(llama, x[:1], 70))


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_eos_cut_where_the_uncompiled_loop_stops(kind: str, llama: nn.Module, gpt: nn.Module) -> None:
    model = llama if kind == "llama" else gpt
    x = prompts(2)
    plain = generate(model, x, 12)
    eos = int(plain[0, 6 + 2])  # row 0 ends at its third token
    for check, pad in ((1, 0), (5, None)):  # pad None: eos pads
        cfg = DecodeConfig(backend="eager", eos_check_every=check)
        want = generate(model, x, 30, eos_token_id=eos, pad_token_id=pad)
        got = generate(model, x, 30, eos_token_id=eos, pad_token_id=pad, compile=cfg)
        assert torch.equal(got, want), (check, pad)
    # one row: it ends at its eos, long before the 30 tokens and between two checks (at 5 and 10)
    want = generate(model, x[:1], 30, eos_token_id=eos, pad_token_id=0)
    assert want.shape == (1, 9)
    assert torch.equal(generate(model, x[:1], 30, eos_token_id=eos, pad_token_id=0, compile=cfg), want)
    # under synced_ranks a rank ending first returns the longest rank's length, padded (generate.py's _longest)
    decoder = model.__dict__["_lz_compiled_decoder"]
    synced = decoder.generate(x[:1], 30, None, eos, 0, lambda done: done, lambda length: length + 4)
    assert synced.shape == (1, 13) and torch.equal(synced[:, :9], want) and synced[0, 9:].eq(0).all()


def test_sampling_from_the_same_generator(gpt: nn.Module) -> None:
    x = prompts()

    def sample(seed: int, **kw) -> torch.Tensor:
        return generate(gpt, x, 8, do_sample=True, top_k=5, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(1, compile=TRACE), sample(1))
    assert not torch.equal(sample(1, compile=TRACE), sample(2, compile=TRACE))


def test_quantized_model() -> None:
    """int4 QuantLinears (the dequantize-then-matmul reference on CPU) traced into the step: the same tokens."""
    model = build("gpt")
    quantize_linears(model, bits=4, group_size=32)
    x = prompts()
    assert torch.equal(generate(model, x, 8, compile=TRACE), generate(model, x, 8))


def test_refusals(gpt: nn.Module) -> None:
    x = prompts()
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(gpt, x, 3, use_cache=False, compile=TRACE)
    mask = torch.ones_like(x)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="equal lengths"):
        generate(build("llama"), x, 3, attention_mask=mask, compile=TRACE)
    with pytest.raises(ValueError, match="needs a KV cache"):
        generate(OwnAttention(), x, 3, compile=TRACE)
    with pytest.raises(TypeError, match="DecodeConfig"):
        generate(gpt, x, 3, compile="yes")  # type: ignore[arg-type]
    released = build("gpt")
    released.blocks[0].attn.qkv.weight.untyped_storage().resize_(0)  # what stage 3 leaves between forwards
    with pytest.raises(ValueError, match="stage 3"):
        generate(released, x, 3, compile=TRACE)
    assert torch.equal(generate(gpt, x, 0, compile=TRACE), x)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="mode"):
        DecodeConfig(mode="fast")
    with pytest.raises(ValueError, match="eos_check_every"):
        DecodeConfig(eos_check_every=0)
    with pytest.raises(ValueError, match="cache_multiple"):
        DecodeConfig(cache_multiple=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="coordinate_descent"):
        DecodeConfig(coordinate_descent="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("device, want", [("cuda", {"triton.cudagraphs": True, "coordinate_descent_tuning": True}),
                                          ("cpu", {"coordinate_descent_tuning": True})])
def test_coordinate_descent_keeps_the_mode(gpt: nn.Module, monkeypatch: pytest.MonkeyPatch, device: str,
                                           want: dict) -> None:
    """torch.compile takes a mode or options, not both: with coordinate_descent the mode's own options (CUDA
    graphs on CUDA, none elsewhere) travel beside the tuning switch; without it the mode is passed as is."""
    seen: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    CompiledDecoder(gpt, DecodeConfig(coordinate_descent=True), hf=False)._compiled(torch.device(device))
    CompiledDecoder(gpt, DecodeConfig(coordinate_descent=False), hf=False)._compiled(torch.device(device))
    assert seen[0]["options"] == want and "mode" not in seen[0]
    assert seen[2]["mode"] == ("reduce-overhead" if device == "cuda" else "default") and "options" not in seen[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_cuda_graphs_equal_uncompiled(kind: str) -> None:
    """On CUDA, mode reduce-overhead: the step is replayed as a CUDA graph (no cudagraph skip recorded); in
    fp32 the tokens equal the uncompiled path's, with and without eos; in bf16 (where a fused kernel's
    rounding may flip a near-tie) the prompt's token (eager in both) is the uncompiled one and replays agree."""
    for dtype in (torch.float32, torch.bfloat16):
        model = build(kind).to("cuda", dtype)
        x = prompts().cuda()
        counters.clear()
        want = generate(model, x, 20)
        got = generate(model, x, 20, compile=True)
        again = generate(model, x, 20, compile=True)
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert torch.equal(again, got) and torch.equal(got[:, :7], want[:, :7]), dtype
        if dtype == torch.float32:
            assert torch.equal(got, want)
            eos = int(want[0, 9])
            assert torch.equal(generate(model, x, 20, eos_token_id=eos, compile=True),
                               generate(model, x, 20, eos_token_id=eos))
