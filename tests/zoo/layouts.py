"""Layouts the community writes outside the big model families: each one touches a weight in a way a
ZeRO engine can get wrong.

* :class:`TorchEncoder` ("encoder"): the PyTorch tutorial's language model, ``nn.TransformerEncoder`` of
  ``nn.TransformerEncoderLayer(batch_first=True)``, pre-norm and post-norm. ``nn.MultiheadAttention`` reads
  ``in_proj_weight`` and ``out_proj.weight`` itself (``F.multi_head_attention_forward``, never calling
  ``out_proj``), and in eval the post-norm layers take torch's fused fast path
  (``torch._transformer_encoder_layer_fwd``), which reads every weight of the layer at once; an
  ``nn.Embedding(padding_idx=0)``, whose padding row never gets a gradient; a learned position table
  (an ``nn.Parameter`` added in ``forward``); validation every VAL_EVERY steps.
* :class:`SharedBlocks` ("shared"): ``nn.LSTM`` and ``nn.GRU`` layers in an ``nn.ModuleList`` (so under
  zero3 each is a unit of its own, gathered and released around its forward; RNN modules keep
  ``_flat_weights``, a list of references to their parameters, refreshed only when a parameter is
  re-assigned through ``__setattr__``: a stale list would make the kernel read old or released
  storage), then ALBERT-style weight sharing (one block applied three times per
  forward, twice of them wrapped whole in non-reentrant ``torch.utils.checkpoint`` as HF's gradient
  checkpointing does, so under zero3 the unit's forward runs again inside backward; then a second
  block once, wrapped in reentrant checkpointing), ``torch.utils.checkpoint`` inside each block's own
  forward too (nested), ``weight_norm`` and ``spectral_norm`` parametrizations (their
  ``original0``/``original1`` parameters, spectral norm's power-iteration buffers updated in every
  training forward), a class token and a CLIP-style learnable temperature used directly in ``forward``.
* :class:`ClampedLM` ("clamped"): weights clamped by the user's code after each step (WGAN's weight
  clipping through ``.data``, CLIP's temperature clamp under ``no_grad``); stages 0-2 follow such writes;
  stage 3 refuses them in the first step (zero/read_watch.py [Note: reads after a step]): its units hold no
  values between the step and the next forward. :class:`ClampedGatheredLM` ("clamped_gathered") makes the same
  clamps inside ``strategy.gathered_params(module, writeback=True)``, the route that error names, which
  stage 3 (offload too) follows.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.zoo.base import N_TRAIN, ZooModule, pattern_tokens

VOCAB = 24
SEQ = 12
PAD = 0


def padded_token_data(n: int = N_TRAIN, seed: int = 1234) -> TensorDataset:
    """Next-token rows over tokens 1..VOCAB-1 whose tails are padding (token 0) for a third of the rows,
    so the padding row of the embedding is looked up every step, and the loss ignores padded targets."""
    rows = pattern_tokens(VOCAB, n, SEQ + 1, seed, low=1)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.where(torch.rand(n, generator=g) < 1 / 3, torch.randint(4, SEQ, (n,), generator=g), SEQ + 1)
    rows = rows.masked_fill(torch.arange(SEQ + 1) >= lengths[:, None], PAD)
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD)


class TokenLM(ZooModule):
    """Shared by the language models here: padded token data, next-token loss, validation, AdamW."""

    VAL_EVERY = 4

    def forward(self, tokens: Tensor) -> Tensor:  # pragma: no cover - each model overrides
        raise NotImplementedError

    def train_data(self) -> Dataset:
        return padded_token_data()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.record(lm_loss(self(x), y))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = lm_loss(self(x), y)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(padded_token_data(n=16, seed=99), batch_size=8, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


class TorchEncoder(TokenLM):
    """The PyTorch tutorial's ``TransformerModel`` (batch-first), with a learned position table."""

    GRADIENT_CLIP_VAL = 0.5

    def __init__(self, d_model: int = 32, nhead: int = 2, d_hid: int = 64) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(1, SEQ, d_model) * 0.02)
        pre = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout=0.0, batch_first=True, norm_first=True)
        post = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout=0.0, batch_first=True)
        self.pre_norm = nn.TransformerEncoder(pre, 2, enable_nested_tensor=False)
        self.post_norm = nn.TransformerEncoder(post, 2)
        self.linear = nn.Linear(d_model, VOCAB)
        self.d_model = d_model

    def configure_optimizers(self):
        # The tutorial's optimizer (SGD, with the Trainer's gradient clipping), not Adam: the key bias of
        # in_proj_bias has a true gradient of zero (softmax ignores a shift of every score by q.b_k), and
        # Adam scales its round-off noise up to full-size steps that no two reduction orders agree on
        # (zero3_offload's CPU Adam drifted 5e-3 there). The tutorial's lr (5.0) is chaotic at this size:
        # at lr 0.5 the clip norm's 1e-7 reduction-order round-off grew to 7e-4 in 8 steps.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def zoo_blocks(self) -> list[nn.Module]:
        return [*self.pre_norm.layers, *self.post_norm.layers]

    def forward(self, tokens: Tensor) -> Tensor:
        pad = tokens == PAD
        x = self.embedding(tokens) * math.sqrt(self.d_model) + self.pos[:, : tokens.shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        x = self.pre_norm(x, mask=causal, is_causal=True)
        x = self.post_norm(x, src_key_padding_mask=pad)  # no causal mask: eval may take the fused fast path
        return self.linear(x)


class SharedBlock(nn.Module):
    """A pre-norm residual MLP block whose MLP runs under activation checkpointing."""

    def __init__(self, d: int, reentrant: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = parametrizations.weight_norm(nn.Linear(d, 2 * d))
        self.fc2 = nn.Linear(2 * d, d)
        self.reentrant = reentrant

    def mlp(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        if self.training:
            h = checkpoint(self.mlp, h, use_reentrant=self.reentrant)
        else:
            h = self.mlp(h)
        return x + h


class SharedBlocks(TokenLM):
    """ALBERT-style sharing plus the other direct uses of weights (see the module docstring)."""

    REPEAT = 3

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.proj = parametrizations.spectral_norm(nn.Linear(d, d))
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.rnns = nn.ModuleList([
            nn.LSTM(d, d, num_layers=2, batch_first=True),
            nn.LSTM(d, d, batch_first=True, bidirectional=True, proj_size=d // 2),
            nn.GRU(d, d, batch_first=True),
            nn.GRU(d, d, batch_first=True),
        ])
        self.blocks = nn.ModuleList([SharedBlock(d, reentrant=False), SharedBlock(d, reentrant=True)])
        self.norm = nn.LayerNorm(d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.5)))

    def zoo_blocks(self) -> list[nn.Module]:
        return [*self.rnns, *self.blocks]

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.proj(self.embedding(tokens))
        for rnn in self.rnns:  # the bidirectional one sees the future: the loss only has to match ddp's
            x, _ = rnn(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]  # causal mixing, no weights
        shared, once = self.blocks
        x = shared(x)
        for _ in range(self.REPEAT - 1):  # HF's gradient checkpointing: the whole block, recomputed in backward
            x = checkpoint(shared, x, use_reentrant=False)
        # Reentrant checkpointing runs a backward of its own per call: ddp cannot take one parameter
        # through several of those ("marked as ready twice"), so the reentrant block runs once.
        x = checkpoint(once, x, use_reentrant=True)
        x = self.norm(x[:, 1:])
        # logits against the (untied) embedding table read outside its module, scaled by a temperature
        return F.linear(F.normalize(x, dim=-1), F.normalize(self.embedding.weight, dim=-1)) * self.logit_scale.exp()


class ClampedLM(TokenLM):
    """Weights changed between steps by the user's own code, after ``optimizer.step()`` (manual
    optimization): WGAN's weight clipping (``p.data.clamp_(-c, c)``, PyTorch's WGAN example) on the
    blocks, CLIP's temperature clamp (``with torch.no_grad(): logit_scale.clamp_(0, log(100))``,
    open_clip) on a parameter used directly in ``forward``. ddp's next step starts from the clamped
    values; ZeRO's masters must too (zero/flat_group.py [Note: writes outside the optimizer])."""

    CLIP = 0.05
    """WGAN's clipping bound: small enough that the blocks' weights reach it within STEPS steps."""
    MAX_SCALE = math.log(4.0)

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embedding = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.logit_scale = nn.Parameter(torch.tensor(self.MAX_SCALE + 0.5))  # clamped after the first step
        self.head = nn.Linear(d, VOCAB)

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x) * self.logit_scale.exp()

    def clamp_context(self) -> AbstractContextManager[None]:
        """Where the clamps run: as the user wrote them (here: nowhere special)."""
        return nullcontext()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = self.record(lm_loss(self(x), y))
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        with self.clamp_context():
            for p in self.layers.parameters():
                p.data.clamp_(-self.CLIP, self.CLIP)
            with torch.no_grad():
                self.logit_scale.clamp_(0, self.MAX_SCALE)


class ClampedGatheredLM(ClampedLM):
    """:class:`ClampedLM`'s clamps inside ``trainer.strategy.gathered_params(self, writeback=True)`` (ddp has no
    such method: plain clamps there), as stage 3's refusal of the plain ones tells users to write them."""

    def clamp_context(self) -> AbstractContextManager[None]:
        gathered = getattr(self.trainer.strategy, "gathered_params", None)
        return gathered(self, writeback=True) if gathered is not None else nullcontext()
