"""An EMA copy of the network held inside the LightningModule, as timm users write it.

:class:`EmaLM` ("ema"): ``self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))`` (torch's
own; timm's ``ModelEmaV3`` is the same shape), frozen (``requires_grad_(False)``, outside the optimizer, as timm
leaves it), updated in ``on_train_batch_end`` and the model validated with. Its parameters are registered
submodule parameters no optimizer steps: stages 1-2 leave them to the user's writes, and they match ddp's.
Under stage 3 both copies are released after the step, and ``update_parameters`` reads them through
``p.detach()``: a segmentation fault on 2 ranks until the first step's watch followed detached aliases
(zero/read_watch.py [Note: detached aliases]); stage 3 now refuses it (REFUSED in test_zoo.py) naming
``gathered_params``, and :class:`EmaGatheredLM` ("ema_gathered") does the update inside
``gathered_params(net)`` + ``gathered_params(ema, writeback=True)``, which stage 3 follows.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.zoo.layouts import VOCAB, TokenLM, lm_loss


class EmaNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)) for _ in range(2)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class EmaLM(TokenLM):
    """The network, its frozen EMA copy (decay 0.9) updated after every batch, validation on the EMA."""

    DECAY = 0.9

    def __init__(self) -> None:
        super().__init__()
        self.net = EmaNet()
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(self.DECAY))
        self.ema.requires_grad_(False)

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.net.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)

    def update_ema(self) -> None:
        self.ema.update_parameters(self.net)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.update_ema()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(float(lm_loss(self.ema(x), y)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.net.parameters(), lr=3e-3, weight_decay=0.01)


class EmaGatheredLM(EmaLM):
    """The same update inside ``gathered_params`` (ddp has none: plain there)."""

    def update_ema(self) -> None:
        gathered = getattr(self.trainer.strategy, "gathered_params", None)
        with ExitStack() as stack:
            if gathered is not None:
                stack.enter_context(gathered(self.net))
                stack.enter_context(gathered(self.ema, writeback=True))
            super().update_ema()
