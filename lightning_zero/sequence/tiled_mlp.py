"""The MLP of a transformer block run over sequence tiles, each recomputed in the backward.

[Note: tiled MLP]
An MLP's intermediate activations (``4 x hidden`` or, gated, ``2 x 3.5 x hidden`` per token) are the largest
in a block at long sequence. A tiled MLP runs on ``tiles`` slices of the sequence, each under non-reentrant
activation checkpointing, so the forward keeps only each tile's input and the backward rebuilds one tile's
intermediates at a time: peak MLP activation memory falls by ``tiles`` at the price of one more MLP forward
(DeepSpeed ALST's TiledMLP). The MLP is token-wise, so outputs and gradients are those of the untiled MLP
(weight gradients add over tiles: equal up to summation order).

The module is not wrapped: its own ``forward`` is replaced on the instance, so parameter names, state-dict
keys and checkpoints are unchanged and forward hooks (ZeRO-3's gathers) still fire once around the call.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

TILED = "_lz_tiles"
"""Attribute marking a module whose forward is tiled (and how many tiles)."""


def _tiled_forward(original: Callable[[Tensor], Tensor], tiles: int, seq_dim: int) -> Callable[..., Tensor]:
    def forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs or x.shape[seq_dim] < tiles:
            return original(x, *args, **kwargs)
        parts = x.tensor_split(tiles, dim=seq_dim)
        if not torch.is_grad_enabled():
            return torch.cat([original(p) for p in parts], dim=seq_dim)
        return torch.cat([checkpoint(original, p, use_reentrant=False) for p in parts], dim=seq_dim)

    return forward


def tile(module: nn.Module, tiles: int, seq_dim: int = 1) -> None:
    """Run ``module`` (token-wise, e.g. a block's MLP) over ``tiles`` slices of dim ``seq_dim``."""
    if tiles < 1:
        raise ValueError(f"tiles must be positive, got {tiles}")
    if getattr(module, TILED, None) or tiles == 1:
        return
    module.forward = types.MethodType(_tiled_forward(module.forward, tiles, seq_dim), module)
    setattr(module, TILED, tiles)


def tile_mlps(model: nn.Module, tiles: int, attribute: str = "mlp") -> int:
    """Tile every submodule named ``attribute`` (HF and nanoGPT blocks call theirs ``mlp``); returns how many
    (0: nothing to tile, which the caller refuses)."""
    found = [child for m in model.modules() if isinstance(child := getattr(m, attribute, None), nn.Module)]
    for child in found:
        tile(child, tiles)
    return len(found)
