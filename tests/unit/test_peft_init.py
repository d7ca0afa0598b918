"""peft LoRA adapters built on the meta device (get_peft_model inside configure_model under ZeRO-3) get
peft's own init when materialised (zero/peft_init.py [Note: peft adapters get their own init]): lora_B
starts at zero, so the adapted model starts as the base model, as under ddp; inits peft computes from the
base weights are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero.zero.materialize import materialize_modules, params_on_meta
from lightning_zero.zero.peft_init import AdapterInitError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CFG = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _build(on_meta: bool, **lora: object) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], **lora)
    if not on_meta:
        return peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)), cfg)
    with params_on_meta():
        model = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)), cfg)
    materialize_modules(list(model.modules()), torch.device("cpu"))
    return model


def _adapters(model: torch.nn.Module, which: str) -> list[torch.Tensor]:
    return [p.detach() for n, p in model.named_parameters() if f"{which}.default" in n]


def test_default_lora_starts_as_the_base_model_with_peft_distributions() -> None:
    meta, plain = _build(True), _build(False)
    b = _adapters(meta, "lora_B")
    assert len(b) == 4 and all(torch.equal(t, torch.zeros_like(t)) for t in b)  # torch's draw: max ~0.35
    a, a_ref = torch.cat([t.flatten() for t in _adapters(meta, "lora_A")]), torch.cat(
        [t.flatten() for t in _adapters(plain, "lora_A")])
    bound = 1 / math.sqrt(128)  # kaiming_uniform(a=sqrt(5)) on Linear(128, 8)
    assert a.abs().max() <= bound and abs(a.std().item() / a_ref.std().item() - 1) < 0.1
    q = meta.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert abs(q.std().item() - 0.02) < 0.002  # the base keeps HF's init (materialize.py)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad(), meta.disable_adapter():
        base = meta(input_ids=ids).logits
    with torch.no_grad():
        adapted = meta(input_ids=ids).logits
    assert torch.equal(base, adapted)  # lora_B = 0: the adapter changes nothing at the start


def test_gaussian_lora_init_is_replayed() -> None:
    a = torch.cat([t.flatten() for t in _adapters(_build(True, init_lora_weights="gaussian"), "lora_A")])
    assert abs(a.std().item() - 1 / 8) < 0.01  # peft: normal(std=1/r)


@pytest.mark.parametrize("lora", [dict(init_lora_weights="pissa"), dict(use_dora=True)])
def test_inits_from_the_base_weights_are_refused(lora: dict) -> None:
    with pytest.raises(AdapterInitError, match=r"get_peft_model in __init__"):
        _build(True, **lora)
