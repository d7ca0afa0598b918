"""2-5. Hugging Face models built from configs (random weights, no download): GPT-2, Llama wrapped by peft
LoRA (frozen base, tiny adapters), T5 (encoder/decoder, relative position bias), BERT masked LM."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from tests.zoo.base import N_TRAIN, ZooModule, pattern_tokens, token_data


class HFCausalLM(ZooModule):
    """A causal LM from ``transformers`` (GPT-2, Llama; optionally wrapped by peft LoRA)."""

    VOCAB, SEQ = 64, 16

    def __init__(self, build: Callable[[], nn.Module], lr: float, blocks: Callable[[nn.Module], list[nn.Module]],
                 zero_gradient: Callable[[nn.Module], list[str]] = lambda m: []) -> None:
        super().__init__()
        self.model = build()
        self.lr = lr
        self._blocks = blocks
        self._zero_gradient = zero_gradient

    def zero_gradient_names(self) -> list[str]:
        """Tensors whose true gradient is zero (GPT-2's fused q/k/v bias: nanogpt.py says why)."""
        return self._zero_gradient(self.model)

    def zoo_blocks(self) -> list[nn.Module]:
        return self._blocks(self.model)

    def train_data(self) -> Dataset:
        return token_data(self.VOCAB, self.SEQ)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        out = self.model(input_ids=x, labels=x)  # HF shifts the labels itself
        return self.record(out.loss)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


def hf_gpt2() -> HFCausalLM:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=HFCausalLM.VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    def qkv_biases(m: nn.Module) -> list[str]:
        return [f"model.transformer.h.{i}.attn.c_attn.bias" for i in range(len(m.transformer.h))]

    return HFCausalLM(lambda: GPT2LMHeadModel(cfg), lr=3e-3, blocks=lambda m: list(m.transformer.h),
                      zero_gradient=qkv_biases)


def hf_gpt2_checkpointed() -> HFCausalLM:
    """GPT-2 with Hugging Face's own activation checkpointing, switched on as its docs say
    (``model.gradient_checkpointing_enable()``, default arguments: torch's reentrant checkpoint in each block)."""
    built = hf_gpt2()
    built.model.gradient_checkpointing_enable()
    assert built.model.is_gradient_checkpointing
    return built


LLAMA_LAYERS = 12


def _llama_lora(checkpointed: bool = False, base_dtype: torch.dtype = torch.float32) -> nn.Module:
    """``checkpointed``: peft's recipe for LoRA with activation checkpointing (``gradient_checkpointing_enable()``,
    torch's reentrant checkpoint, and ``enable_input_require_grads()`` so the frozen embeddings' output carries a
    gradient into each checkpointed block), 4 layers. ``base_dtype``: the base model loaded in it (``bfloat16``:
    the QLoRA-style memory saving; peft keeps the adapters in fp32, ``autocast_adapter_dtype``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=HFCausalLM.VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4 if checkpointed else LLAMA_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0,
    )
    base = LlamaForCausalLM(cfg).to(base_dtype)
    if checkpointed:
        base.gradient_checkpointing_enable()
        base.enable_input_require_grads()
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(base, lora)


def hf_llama_lora() -> HFCausalLM:
    # PeftModel -> LoraModel (.base_model) -> LlamaForCausalLM (.model) -> LlamaModel (.model) -> layers
    return HFCausalLM(_llama_lora, lr=1e-2, blocks=lambda m: list(m.base_model.model.model.layers))


def hf_llama_lora_bf16_base() -> HFCausalLM:
    """The base in bf16, frozen, the fp32 adapters trained under ``32-true`` (stage 3 gathered the frozen base in
    fp32 and the adapters' own ``x.to(lora_A.weight.dtype)`` path met a dtype mismatch)."""
    return HFCausalLM(lambda: _llama_lora(base_dtype=torch.bfloat16), lr=1e-2,
                      blocks=lambda m: list(m.base_model.model.model.layers))


def hf_llama_lora_checkpointed() -> HFCausalLM:
    return HFCausalLM(lambda: _llama_lora(checkpointed=True), lr=1e-2,
                      blocks=lambda m: list(m.base_model.model.model.layers))


def hf_mixtral() -> HFCausalLM:
    """Mixtral: a sparse MoE block in every layer (a top-2 router over 4 experts, the experts fused into 3-D
    parameters as transformers 5 writes them) trained with its router's load-balancing loss, as fine-tuning recipes
    switch it on (``output_router_logits=True``): experts that get no token on a rank get a zero gradient there."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=HFCausalLM.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, attention_dropout=0.0,
    )
    return HFCausalLM(lambda: MixtralForCausalLM(cfg), lr=3e-3, blocks=lambda m: list(m.model.layers))


def hf_gemma2() -> HFCausalLM:
    """Gemma 2: tied embeddings scaled by sqrt(hidden) (a computed normaliser), RMSNorm's ``1 + weight``, four norms
    per layer, attention and final-logit soft-capping, and sliding-window attention on every other layer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=HFCausalLM.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=8, attention_dropout=0.0,
        attn_implementation="eager",
    )
    return HFCausalLM(lambda: Gemma2ForCausalLM(cfg), lr=3e-3, blocks=lambda m: list(m.model.layers))


class HFT5(ZooModule):
    """T5: encoder and decoder stacks, embeddings tied three ways, relative position bias passed on."""

    VOCAB, SEQ = 64, 12

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(
            vocab_size=self.VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
        self.model = T5ForConditionalGeneration(cfg)

    def train_data(self) -> Dataset:
        g = torch.Generator().manual_seed(4321)
        src = torch.randint(2, self.VOCAB, (N_TRAIN, self.SEQ), generator=g)
        return TensorDataset(src, src.flip(1).contiguous())  # learn to reverse the sequence

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        src, tgt = batch
        return self.record(self.model(input_ids=src, labels=tgt).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


class HFBert(ZooModule):
    """BERT masked LM (decoder weight tied to the word embeddings, token-type embeddings, no pooler)."""

    VOCAB, SEQ, MASK_ID = 64, 16, 3

    def __init__(self) -> None:
        super().__init__()
        self.model = self.build()

    def build(self) -> nn.Module:
        """The masked LM (subclasses swap in another architecture and keep the data, step and optimizer)."""
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(
            vocab_size=self.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        return BertForMaskedLM(cfg)

    def train_data(self) -> Dataset:
        return self.masked_data(self.VOCAB, self.SEQ, self.MASK_ID)

    @staticmethod
    def masked_data(vocab: int, seq: int, mask_id: int) -> Dataset:
        """A quarter of the tokens masked (the first of each row always), labels -100 elsewhere."""
        g = torch.Generator().manual_seed(777)
        tokens = pattern_tokens(vocab, N_TRAIN, seq, seed=778, low=5)
        masked = torch.rand(tokens.shape, generator=g) < 0.25
        masked[:, 0] = True  # at least one prediction per row
        inputs = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        return TensorDataset(inputs, labels)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        return self.record(self.model(input_ids=inputs, labels=labels).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


class HFDeberta(HFBert):
    """DeBERTa-v2 masked LM: disentangled attention whose relative-position table (``encoder.rel_embeddings``, an
    ``nn.Embedding``) is never called: every layer reads its ``.weight`` directly (``get_rel_embedding``), then
    LayerNorms it; the MLM head ties to the word embeddings."""

    def build(self) -> nn.Module:
        from transformers import DebertaV2Config, DebertaV2ForMaskedLM

        cfg = DebertaV2Config(
            vocab_size=self.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            relative_attention=True, position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
            pos_att_type=["p2c", "c2p"], share_att_key=True, position_biased_input=False,
        )
        return DebertaV2ForMaskedLM(cfg)
