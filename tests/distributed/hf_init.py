"""Scenario ``distributed.hf_init`` (registered in scenarios.py): Hugging Face models built in
``configure_model`` under zero3 get Hugging Face's initialisation, as under ddp (zero/materialize.py
[Note: Hugging Face models get their own init]), and ``from_pretrained`` there keeps the loaded weights.

:func:`run` fits each family for one step at lr 0 and, once set up (``on_fit_start``), takes per-parameter
statistics of the gathered weights beside those of the same model built plainly (what ddp trains: HF's
``post_init`` ran on real tensors). The test compares them (test_hf_init.py).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402

import lightning_zero  # noqa: E402,F401  (registers "zero3")

VOCAB, HIDDEN, SEQ = 512, 256, 8
"""Tokens are drawn below 64, the tiny pretrained Llama's vocabulary (test_hf_init.py)."""


def families() -> dict[str, Callable[[], nn.Module]]:
    """Big enough for a parameter's std to be estimated within ~1% (the smallest random one has 16k values)."""
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),  # q/k/v biases: zeros under HF, not torch's draw
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                                    n_positions=64)),  # scaled c_proj, set by the parent module
        "bert": lambda: BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=2 * HIDDEN,
                                                   max_position_embeddings=64)),
    }


def param_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per parameter (tied ones once): numel, mean, std, min, max in float64."""
    out = {}
    for name, p in model.named_parameters():
        v = p.detach().double()
        out[name] = {"numel": v.numel(), "mean": v.mean().item(), "std": v.std().item() if v.numel() > 1 else 0.0,
                     "min": v.min().item(), "max": v.max().item()}
    return out


def _ties(model: nn.Module) -> int:
    """Parameters registered in more than one slot (a tied head and embedding)."""
    return sum(1 for _ in model.named_parameters(remove_duplicate=False)) - sum(1 for _ in model.parameters())


class HFModule(pl.LightningModule):
    def __init__(self, build: Callable[[], nn.Module], reference: Optional[dict[str, torch.Tensor]] = None) -> None:
        super().__init__()
        self.build, self.reference = build, reference
        self.model: Optional[nn.Module] = None
        self.found: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()

    def on_fit_start(self) -> None:
        assert self.model is not None
        with self.trainer.strategy.gathered_params(self.model):
            self.found["stats"] = param_stats(self.model)
            self.found["ties"] = _ties(self.model)
            if self.reference is not None:
                sd = self.model.state_dict()
                self.found["pretrained_mismatch"] = [k for k, v in self.reference.items()
                                                     if not torch.equal(sd[k], v)]

    def training_step(self, batch, batch_idx):
        assert self.model is not None
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        data = torch.randint(0, 64, (2 * self.trainer.world_size, SEQ), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)


def _fit(module: HFModule, devices: int) -> dict[str, Any]:
    pl.Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, strategy="zero3").fit(module)
    return module.found


def run(devices: int, pretrained_dir: str) -> dict[str, Any]:
    """``{family: {"zero3": stats, "plain": stats, "ties": (zero3, plain)}, "pretrained_mismatch": [...]}``."""
    from transformers import LlamaForCausalLM

    result: dict[str, Any] = {}
    for name, build in families().items():
        torch.manual_seed(1)
        plain = build()
        found = _fit(HFModule(build), devices)
        result[name] = {"zero3": found["stats"], "plain": param_stats(plain), "ties": (found["ties"], _ties(plain))}
    saved = LlamaForCausalLM.from_pretrained(pretrained_dir).state_dict()
    found = _fit(HFModule(lambda: LlamaForCausalLM.from_pretrained(pretrained_dir), saved), devices)
    result["pretrained_mismatch"] = found["pretrained_mismatch"]
    result["pretrained_checked"] = len(saved)
    return result
