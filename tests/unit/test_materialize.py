"""ZeRO-3 sharded initialisation never leaves a parameter uninitialised (zero/materialize.py
[Note: no uninitialised parameters]): values a module cannot re-create are kept from construction,
and a parameter nothing initialises is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.zero.materialize import MetaLoadError, UninitializedParameterError, materialize_modules, params_on_meta


class ScaleNorm(nn.Module):
    """HF-style norm: a bare parameter made with torch.ones, and no reset_parameters."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = ScaleNorm(d)
        self.lin = nn.Linear(d, d)


def test_values_without_reset_parameters_survive_meta_construction() -> None:
    torch.manual_seed(0)
    with params_on_meta():
        block = Block()
    assert all(p.is_meta for p in block.parameters())
    materialize_modules(list(block.modules()), torch.device("cpu"))
    assert torch.equal(block.norm.weight, torch.full((8,), 3.0))
    assert not any(bool(torch.isnan(p).any()) for p in block.parameters())  # Linear: its reset_parameters
    assert block.lin.weight.abs().sum() > 0


def test_the_init_hook_may_initialise_what_nothing_else_does() -> None:
    class Custom(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.gate = nn.Parameter(torch.empty(3, device="meta"))  # reset_parameters does not cover it

    seen = []

    def hook(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        if isinstance(module, Custom):
            module.gate.fill_(0.5)

    m = Custom()
    materialize_modules([m], torch.device("cpu"), hook)
    assert seen == ["Custom"] and torch.equal(m.gate, torch.full((3,), 0.5))


def test_a_parameter_nothing_initialises_is_refused_by_name() -> None:
    class Custom(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.gate = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(UninitializedParameterError, match=r"Custom\.gate"):
        materialize_modules([Custom()], torch.device("cpu"))


def test_weights_built_before_the_context_keep_their_values() -> None:
    """[Note: the user's weights are kept]: a parameter replacing a real one (parallelize_module's
    re-registration, a rewrite, a real one replacing a meta one) and an existing parameter registered in
    another slot (a tie) stay real with their values; what a constructor creates inside goes to meta."""
    torch.manual_seed(0)
    owner = nn.Module()
    owner.a, owner.b = Block(), Block()
    before = {n: p.detach().clone() for n, p in owner.named_parameters()}
    with params_on_meta(owner):
        owner.a.lin.weight = nn.Parameter(owner.a.lin.weight.detach() * 1.0)  # a new object, the same values
        owner.b.lin.weight = owner.a.norm.weight  # a tie to a weight that exists, into a slot that held one
        del owner.b.lin.bias
        owner.b.lin.bias = owner.a.lin.bias  # an existing parameter in an empty slot
        owner.c = Block()  # built inside: ours to initialise
        owner.c.lin.weight = nn.Parameter(torch.zeros(8, 8))  # the user's values, replacing a meta one
    assert torch.equal(owner.a.lin.weight, before["a.lin.weight"])
    assert owner.b.lin.weight is owner.a.norm.weight and owner.b.lin.bias is owner.a.lin.bias
    assert not any(p.is_meta for p in (*owner.a.parameters(), *owner.b.parameters()))
    assert owner.c.lin.bias.is_meta and owner.c.norm.weight.is_meta
    materialize_modules(list(owner.c.modules()), torch.device("cpu"))
    assert torch.equal(owner.c.lin.weight, torch.zeros(8, 8))  # through Linear.reset_parameters()


def test_a_load_into_a_model_built_on_meta_is_kept_with_assign_and_refused_without() -> None:
    """Loading a state_dict inside configure_model: with ``assign=True`` the loaded tensors are registered and
    kept; without, torch copies nothing into meta parameters (it only warns): refused with a clear error."""
    torch.manual_seed(0)
    saved = Block().state_dict()
    with params_on_meta():
        block = Block()
        block.load_state_dict(saved, assign=True)
    materialize_modules(list(block.modules()), torch.device("cpu"))
    for k, v in block.state_dict().items():
        assert torch.equal(v, saved[k]), k
    with params_on_meta():
        again = Block()
        with pytest.raises(MetaLoadError, match="assign=True"):
            again.load_state_dict(dict(saved))  # not saved itself: torch wrote assign=True into its _metadata


def test_a_module_that_also_gets_a_new_parameter_keeps_its_real_ones() -> None:
    """reset_parameters() of a module with one new (meta) parameter would re-initialise its real ones too."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    weight = lin.weight.detach().clone()
    with params_on_meta(lin):
        del lin.bias
        lin.bias = nn.Parameter(torch.zeros(4))  # new, into an empty slot: on meta, reset_parameters sets it
    assert lin.bias.is_meta and not lin.weight.is_meta
    materialize_modules([lin], torch.device("cpu"))
    assert torch.equal(lin.weight, weight) and not bool(torch.isnan(lin.bias).any())


def test_a_hugging_face_model_built_on_meta_gets_its_own_init_and_keeps_the_users_weights() -> None:
    """[Note: Hugging Face models get their own init]: after materialisation a GPT-2 built on meta has HF's
    init (embeddings std 0.02 not torch's 1.0, LayerNorms ones/zeros, c_proj scaled by its parent module), the
    nearest PreTrainedModel's _init_weights is found under a plain wrapper, and a real weight the user put
    in place survives its parent's _init_weights (held and put back), and a module added after post_init keeps
    torch's init."""
    transformers = pytest.importorskip("transformers")
    from lightning_zero.zero.materialize import hf_initializers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)
    torch.manual_seed(0)
    wrapper = nn.Module()
    with params_on_meta():
        wrapper.gpt = transformers.GPT2LMHeadModel(cfg)
        wrapper.head = nn.Linear(4, 4)  # outside the HF model: torch's reset_parameters, as under ddp
        wrapper.gpt.transformer.h[1].attn.c_proj.weight = nn.Parameter(torch.full((64, 64), 0.5))
        wrapper.gpt.score = nn.Linear(64, 64)  # added after post_init (as peft's LoRA layers): torch's init
    gpt = wrapper.gpt
    inits = hf_initializers(wrapper)
    # the nearest PreTrainedModel, as transformers' smart_apply dispatches: GPT2Model is one itself
    assert inits[id(gpt.transformer.h[0].mlp.c_fc)].__self__ is gpt.transformer
    assert inits[id(gpt.lm_head)].__self__ is gpt and id(wrapper.head) not in inits
    assert id(wrapper) not in inits
    materialize_modules(list(wrapper.modules()), torch.device("cpu"), hf_inits=inits)
    assert abs(gpt.transformer.wte.weight.std().item() / 0.02 - 1) < 0.1
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # the tie survives
    assert torch.equal(gpt.transformer.h[0].ln_1.weight, torch.ones(64))
    assert torch.equal(gpt.transformer.h[0].attn.c_attn.bias, torch.zeros(192))
    assert abs(gpt.transformer.h[0].attn.c_proj.weight.std().item() / (0.02 / 2) - 1) < 0.1  # 0.02 / sqrt(2 * 2)
    assert torch.equal(gpt.transformer.h[1].attn.c_proj.weight, torch.full((64, 64), 0.5))  # the user's
    assert id(gpt.score) not in inits
    assert gpt.score.weight.abs().max() <= 1 / 8 and gpt.score.weight.std() > 0.06  # torch's: uniform(+-1/sqrt(64))
    bound = 1 / 2  # Linear(4, 4): kaiming_uniform(a=sqrt(5)) bound 1/sqrt(fan_in)
    assert wrapper.head.weight.abs().max() <= bound and wrapper.head.weight.std() > 0.1
