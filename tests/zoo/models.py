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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

STEPS = 12
"""Optimizer steps per run; every data set below holds more than STEPS x 2 ranks x BATCH samples."""
BATCH = 4
N_TRAIN = 128


# ====================================================================== shared pieces
class ZooModule(LightningModule):
    """Loss recording and the sharded, never-shuffled training loader every zoo model shares."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def train_data(self) -> Dataset:  # pragma: no cover - each model overrides
        raise NotImplementedError

    def zoo_blocks(self) -> list[nn.Module]:
        return []

    def train_dataloader(self) -> DataLoader:
        data = self.train_data()
        kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def record(self, loss: Tensor) -> Tensor:
        self.losses.append(float(loss.detach()))
        return loss


def pattern_tokens(vocab: int, n: int, length: int, seed: int, low: int = 0) -> Tensor:
    """Rows ``low + (start + stride * t) % (vocab - low)`` with a random start and stride in 1..3: random
    looking, but learnable from context, so the language models' losses fall within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - low, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return low + (start + stride * torch.arange(length)) % (vocab - low)


def token_data(vocab: int, seq: int, n: int = N_TRAIN, seed: int = 1234) -> TensorDataset:
    """Token rows split into (inputs, next-token targets); the same on every rank."""
    rows = pattern_tokens(vocab, n, seq + 1, seed)
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


# ====================================================================== 1. nanoGPT (Karpathy's model.py)
@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 12
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float]):
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


class NanoGPT(ZooModule):
    def __init__(self, config: Optional[GPTConfig] = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.model = GPT(self.config)

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.model.transformer.h)

    def train_data(self) -> Dataset:
        return token_data(self.config.vocab_size, self.config.block_size)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        return self.record(loss)

    def configure_optimizers(self):
        return self.model.configure_optimizers(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95))


# ====================================================================== 2-5. Hugging Face models from configs
class HFCausalLM(ZooModule):
    """A causal LM from ``transformers`` (GPT-2, Llama; optionally wrapped by peft LoRA)."""

    VOCAB, SEQ = 64, 16

    def __init__(self, build: Callable[[], nn.Module], lr: float, blocks: Callable[[nn.Module], list[nn.Module]]) -> None:
        super().__init__()
        self.model = build()
        self.lr = lr
        self._blocks = blocks

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
    return HFCausalLM(lambda: GPT2LMHeadModel(cfg), lr=3e-3, blocks=lambda m: list(m.transformer.h))


LLAMA_LAYERS = 12


def _llama_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=HFCausalLM.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LLAMA_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0,
    )
    base = LlamaForCausalLM(cfg)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(base, lora)


def hf_llama_lora() -> HFCausalLM:
    # PeftModel -> LoraModel (.base_model) -> LlamaForCausalLM (.model) -> LlamaModel (.model) -> layers
    return HFCausalLM(_llama_lora, lr=1e-2, blocks=lambda m: list(m.base_model.model.model.layers))


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
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(
            vocab_size=self.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = BertForMaskedLM(cfg)

    def train_data(self) -> Dataset:
        g = torch.Generator().manual_seed(777)
        tokens = pattern_tokens(self.VOCAB, N_TRAIN, self.SEQ, seed=778, low=5)
        masked = torch.rand(tokens.shape, generator=g) < 0.25
        masked[:, 0] = True  # at least one prediction per row
        inputs = torch.where(masked, torch.full_like(tokens, self.MASK_ID), tokens)
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        return TensorDataset(inputs, labels)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        return self.record(self.model(input_ids=inputs, labels=labels).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


# ====================================================================== 6. timm-style ViT
class PatchEmbed(nn.Module):
    """2D Image to Patch Embedding (timm.layers.PatchEmbed, flatten=True, no norm)."""

    def __init__(self, img_size: int = 16, patch_size: int = 4, in_chans: int = 3, embed_dim: int = 32) -> None:
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=True)
        self.norm = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)
        x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        x = self.norm(x)
        return x


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Mlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class ViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class VisionTransformer(nn.Module):
    """timm's layout: cls_token/pos_embed on the root, ``blocks`` an nn.Sequential, token pooling."""

    def __init__(
        self, img_size: int = 16, patch_size: int = 4, in_chans: int = 3, num_classes: int = 10,
        embed_dim: int = 32, depth: int = 12, num_heads: int = 2, mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.num_prefix_tokens = 1
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + self.num_prefix_tokens, embed_dim) * 0.02)
        self.pos_drop = nn.Dropout(p=0.0)
        self.norm_pre = nn.Identity()
        self.blocks = nn.Sequential(*[ViTBlock(embed_dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.fc_norm = nn.Identity()
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def _pos_embed(self, x: Tensor) -> Tensor:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.norm_pre(x)
        x = self.blocks(x)
        x = self.norm(x)
        return x

    def forward_head(self, x: Tensor) -> Tensor:
        x = x[:, 0]  # class token
        x = self.fc_norm(x)
        x = self.head_drop(x)
        return self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def image_data(shape: tuple[int, ...], classes: int, n: int = N_TRAIN, seed: int = 2024) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn((n, *shape), generator=g), torch.randint(0, classes, (n,), generator=g))


class TimmViT(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = VisionTransformer()

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.model.blocks)

    def train_data(self) -> Dataset:
        return image_data((3, 16, 16), 10)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.record(F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.05)


# ====================================================================== 7. torchvision-style ResNet
def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, int, int, int] = (1, 1, 1, 1), widths: tuple[int, ...] = (4, 8, 16, 32),
                 num_classes: int = 10) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(widths[0], layers[0])
        self.layer2 = self._make_layer(widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * BasicBlock.expansion, stride),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


class TorchvisionResNet(ZooModule):
    """BatchNorm running stats: ddp broadcasts rank 0's buffers before each forward (the first
    validation batch included), so every rank validates with rank 0's statistics."""

    VAL_EVERY = 4

    def __init__(self) -> None:
        super().__init__()
        self.model = ResNet()

    def train_data(self) -> Dataset:
        return image_data((3, 32, 32), 10)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.record(F.cross_entropy(self.model(x), y))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(image_data((3, 32, 32), 10, n=16, seed=99), batch_size=8, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


# ====================================================================== 8. Lightning's GAN recipe
class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 32, normalize=False),
            *block(32, 64),
            *block(64, 128),
            nn.Linear(128, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        img = self.model(z)
        img = img.view(img.size(0), *self.img_shape)
        return img


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 64),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(64, 32),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(32, 1),
            nn.Sigmoid(),
        )

    def forward(self, img: Tensor) -> Tensor:
        img_flat = img.view(img.size(0), -1)
        validity = self.model(img_flat)
        return validity


class GAN(ZooModule):
    """Lightning's basic GAN tutorial, step for step (manual optimization, toggle/untoggle).

    One deviation: the noise comes from a generator seeded by (step, rank) instead of the global RNG,
    so that the comparison with ddp does not depend on how much global randomness a strategy consumes.
    """

    def __init__(self, channels: int = 1, width: int = 8, height: int = 8, latent_dim: int = 16, lr: float = 2e-3,
                 b1: float = 0.5, b2: float = 0.999) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        data_shape = (channels, width, height)
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=data_shape)
        self.discriminator = Discriminator(img_shape=data_shape)
        self.g_losses: list[float] = []
        self.d_losses: list[float] = []

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def zero_gradient_names(self) -> list[str]:
        """The biases of the generator's Linear layers that feed a BatchNorm, and that BatchNorm's
        running mean. BatchNorm subtracts the batch mean, so in exact arithmetic these biases get no
        gradient; in floating point they get noise (~1e-10, below Adam's eps) that Adam still turns
        into steps of ~lr/100. Any optimizer implementation that is not bitwise torch's (the compiled
        CPU Adam of ``zero3_offload``: ~5e-8 on every other tensor) changes that noise completely, so
        these tensors drift apart by ~1e-3 while every loss still matches: they are compared loosely."""
        layers = list(self.generator.model)
        names = []
        for i, (layer, nxt) in enumerate(zip(layers, layers[1:])):
            if isinstance(layer, nn.Linear) and isinstance(nxt, nn.BatchNorm1d):
                names += [f"generator.model.{i}.bias", f"generator.model.{i + 1}.running_mean"]
        return names

    def adversarial_loss(self, y_hat: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy(y_hat, y)

    def train_data(self) -> Dataset:
        g = torch.Generator().manual_seed(55)
        c, w, h = self.hparams.channels, self.hparams.width, self.hparams.height
        base = torch.linspace(-1, 1, w * h).view(1, c, w, h)
        imgs = (base * torch.rand(N_TRAIN, 1, 1, 1, generator=g) + 0.1 * torch.randn(N_TRAIN, c, w, h, generator=g)).tanh()
        return TensorDataset(imgs, torch.zeros(N_TRAIN, dtype=torch.long))

    def _noise(self, n: int) -> Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_step + self.trainer.global_rank)
        return torch.randn(n, self.hparams.latent_dim, generator=g)

    def training_step(self, batch: tuple[Tensor, Tensor]) -> None:
        imgs, _ = batch

        optimizer_g, optimizer_d = self.optimizers()

        # sample noise
        z = self._noise(imgs.shape[0])
        z = z.type_as(imgs)

        # train generator
        # generate images
        self.toggle_optimizer(optimizer_g)
        self.generated_imgs = self(z)

        # ground truth result (ie: all fake)
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        # adversarial loss is binary cross-entropy
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.g_losses.append(float(g_loss.detach()))
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # train discriminator
        # Measure discriminator's ability to classify real from generated samples
        self.toggle_optimizer(optimizer_d)

        # how well can it label as real?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        # how well can it label as fake?
        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        # discriminator loss is the average of these
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.d_losses.append(float(d_loss.detach()))
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []


# ====================================================================== registry
MODELS: dict[str, Callable[[], ZooModule]] = {
    "nanogpt": NanoGPT,
    "gpt2": hf_gpt2,
    "llama_lora": hf_llama_lora,
    "t5": HFT5,
    "bert": HFBert,
    "vit": TimmViT,
    "resnet": TorchvisionResNet,
    "gan": GAN,
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
