"""``torch.nn.utils.prune`` applied before fit, as its tutorial writes it.

:class:`PrunedLM` ("pruned"): ``l1_unstructured`` on a block's weight, ``random_unstructured`` on the head's
weight and ``l1_unstructured`` on a bias, before the Trainer sees the module: each pruned tensor becomes a
``<name>_orig`` Parameter and a ``<name>_mask`` buffer, and a forward pre-hook registered at pruning time
recomputes ``<name> = <name>_orig * <name>_mask`` as a plain attribute before every forward (stage 3's own
pre-hook runs after it on the same module, so the product must read gathered values). Every stage trains
like ddp. Pruning during training (Lightning's ``ModelPruning``) is refused (lightning_zero/trainer_checks.py).
"""

from __future__ import annotations

import torch.nn.utils.prune as prune
from torch import Tensor, nn

from tests.zoo.ema import EmaNet
from tests.zoo.layouts import TokenLM


class PrunedLM(TokenLM):
    def __init__(self) -> None:
        super().__init__()
        self.net = EmaNet()
        prune.l1_unstructured(self.net.layers[0][0], "weight", amount=0.3)
        prune.random_unstructured(self.net.head, "weight", amount=0.25)  # after seeding: the same mask on every rank
        prune.l1_unstructured(self.net.layers[1][0], "bias", amount=0.5)

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.net.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)
