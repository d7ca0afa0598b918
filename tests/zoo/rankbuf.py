"""Buffers that change on some ranks only, updated in forward from this rank's own batch.

:class:`RankBufferLM` ("rankbuf"): a calibration-style statistic (``peak``: the largest activation seen, raised
only when this rank's batch exceeds it) and a counter of batches holding padding (``batches``, with a ``scale``
that decays each time), both read in the same forward, so rank 0's values (which ddp broadcasts before each
forward) shape the loss. About one batch in five has no padded row, so from time to time the counter moves on one
rank and not the other: each rank deciding alone which modules to broadcast hung at the collective timeout
(found 2026-11); the ranks now agree on the changed set first (zero/buffers.py [Note: buffer sync]) and every
stage trains like ddp.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tests.zoo.ema import EmaNet
from tests.zoo.layouts import PAD, TokenLM


class RunningPeak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("peak", torch.zeros(()))
        self.register_buffer("hits", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            m = x.detach().abs().max()
            if m > self.peak:  # this rank's batch only: the ranks' buffers part ways
                self.peak.copy_(m)
                self.hits += 1
        return x / self.peak.clamp_min(1.0)


class PaddedBatches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("batches", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, tokens: Tensor) -> Tensor:
        if self.training and bool((tokens == PAD).any()):  # this rank's batch only
            self.batches += 1
            self.scale.mul_(0.97)
        return self.scale


class RankBufferLM(TokenLM):
    def __init__(self) -> None:
        super().__init__()
        self.net = EmaNet()
        self.peak = RunningPeak()
        self.padded = PaddedBatches()

    def zoo_blocks(self) -> list[nn.Module]:
        return list(self.net.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.peak(self.net(tokens)) * (4.0 * self.padded(tokens))
