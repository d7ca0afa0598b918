"""The model zoo: the layouts people bring, as tiny random-weight LightningModules (no downloads).

Each module is written the way its source project writes it (nanoGPT's ``model.py``, timm's
``VisionTransformer``, torchvision's ``ResNet``, Hugging Face models built from configs, a peft LoRA
wrapper, Lightning's own GAN recipe), because how a model calls its blocks, ties its weights and
keeps its buffers is exactly what a ZeRO engine can get wrong.

Shared contract (read by ``tests/zoo/scenarios.py``):

* ``losses``: the loss of every training step on this rank (the GAN records ``g_losses`` and
  ``d_losses`` instead); ``val_losses``: every validation batch's loss on this rank (ResNet only);
* ``zoo_blocks()``: the repeated blocks whose forward the stage-3 memory probe watches ([] if none);
* the training data is a fixed synthetic data set, identical on every rank, sharded by a
  ``DistributedSampler(shuffle=False)`` with the strategy's own sampler arguments (the Trainer runs
  with ``use_distributed_sampler=False``, as in tests/helpers/parity_model.py).

One file per family: base.py (ZooModule and the synthetic data sets), nanogpt.py, hf.py (GPT-2, Llama + LoRA, T5, BERT;
GPT-2 and Llama + LoRA also with HF's gradient_checkpointing_enable(), peft's recipe), vit.py, resnet.py (and a
channels_last conv net), gan.py, layouts.py (nn.TransformerEncoder, LSTM/GRU, shared blocks,
parametrizations, weight clamping), renorm.py (a weight renormalised by assigning ``.data``), legacy.py (hook-based spectral/weight norm), fno.py (complex weights as real
pairs), ema.py (an EMA copy inside the module), qat.py
(quantization-aware training), pruned.py (torch.nn.utils.prune before fit), rankbuf.py (a buffer updated on some
ranks only); this file is the registry the scenarios build from.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from tests.zoo.base import BATCH, N_TRAIN, STEPS, ZooModule
from tests.zoo.ema import EmaGatheredLM, EmaLM
from tests.zoo.gan import GAN
from tests.zoo.hf import (HFBert, HFDeberta, HFT5, hf_gemma2, hf_gpt2, hf_gpt2_checkpointed, hf_llama_lora,
                          hf_llama_lora_bf16_base, hf_llama_lora_checkpointed, hf_mixtral)
from tests.zoo.legacy import LegacyNorms
from tests.zoo.fno import FNO
from tests.zoo.layouts import ClampedGatheredLM, ClampedLM, SharedBlocks, TorchEncoder
from tests.zoo.nanogpt import NanoGPT, nanogpt_dropout
from tests.zoo.pruned import PrunedLM
from tests.zoo.qat import QATConvNet
from tests.zoo.rankbuf import RankBufferLM
from tests.zoo.renorm import RenormedGatheredHead, RenormedHead
from tests.zoo.resnet import ChannelsLastConvNet, TorchvisionResNet
from tests.zoo.vit import TimmViT


MODELS: dict[str, Callable[[], ZooModule]] = {
    "nanogpt": NanoGPT,
    "nanogpt_dropout": nanogpt_dropout,
    "gpt2": hf_gpt2,
    "gpt2_ckpt": hf_gpt2_checkpointed,
    "llama_lora": hf_llama_lora,
    "llama_lora_ckpt": hf_llama_lora_checkpointed,
    "llama_lora_bf16": hf_llama_lora_bf16_base,
    "mixtral": hf_mixtral,
    "deberta": HFDeberta,
    "gemma2": hf_gemma2,
    "t5": HFT5,
    "bert": HFBert,
    "vit": TimmViT,
    "resnet": TorchvisionResNet,
    "gan": GAN,
    "encoder": TorchEncoder,
    "shared": SharedBlocks,
    "clamped": ClampedLM,
    "clamped_gathered": ClampedGatheredLM,
    "renormed": RenormedHead,
    "renormed_gathered": RenormedGatheredHead,
    "rankbuf": RankBufferLM,
    "legacy_norms": LegacyNorms,
    "fno": FNO,
    "channels_last": ChannelsLastConvNet,
    "ema": EmaLM,
    "ema_gathered": EmaGatheredLM,
    "qat": QATConvNet,
    "pruned": PrunedLM,
}
"""Model name -> builder (call it right after seeding; every rank builds the same weights)."""


def build(name: str) -> ZooModule:
    return MODELS[name]()


def describe(model: nn.Module) -> dict[str, Any]:
    """Parameter counts of a freshly built model (unique parameters, as ddp holds them)."""
    params = list(model.parameters())
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "frozen_bytes": sum(p.numel() * p.element_size() for p in params if not p.requires_grad),
        "n_params": sum(p.numel() for p in params),
    }


__all__ = ["BATCH", "MODELS", "N_TRAIN", "STEPS", "ZooModule", "build", "describe"]
