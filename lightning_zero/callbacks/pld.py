"""Progressive Layer Dropping (Zhang & He, "Accelerating Training of Transformer-Based Language Models
with Progressive Layer Dropping", NeurIPS 2020; DeepSpeed's ``progressive_layer_drop``).

[Note: the schedule]
Over time, the global keep ratio decays from 1 towards ``theta`` (DeepSpeed's ``ProgressiveLayerDrop
.update_state``, unchanged): ``theta(t) = (1 - theta) * exp(-gamma * t) + theta`` at optimizer step
``t``. Over depth, layer ``l = 1..L`` (1-based, the paper's Eq. for theta_i) is kept with probability
``p_l(t) = 1 - (l / L) * (1 - theta(t))``: the first layer almost always, the last with
``theta(t)``. (DeepSpeed's BERT example samples layer ``i = 0..L-1`` with ``1 - i/L (1 - theta)`` and
then scales with the *next* layer's probability, an off-by-one; we use the paper's depth index for
both.) The expected number of executed layers per step is ``sum_l p_l(t)``.

[Note: a dropped layer]
A dropped layer is the identity: it is not called, so it costs no compute, saves no activations and,
under ZeRO-3, is not gathered. A kept layer's residual branches are scaled by ``1 / p_l`` during
training (as in DeepSpeed's BERT example and stochastic depth), so each branch's expected contribution
equals its contribution at evaluation, where every layer runs unscaled. ``scale=False`` turns that off.
With ``p_l = 1`` nothing is multiplied at all, so ``theta=1`` is bitwise the same as no PLD.

[Note: the same decision on every rank]
Every rank must drop the same layers: under ddp a layer dropped on one rank only would leave its
gradient unreduced there, under ZeRO-3 its gathers would differ (the engine can catch up with
skipped units, stage3.py [Note: units skipped on one rank], but that costs the gathers anyway). The
draw therefore uses no global random state and no communication: a private generator seeded from
``(seed, global step, batch index)``, identical on every rank, and on resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override


def theta_at(step: int, theta: float, gamma: float) -> float:
    """The global keep ratio at optimizer step ``step`` ([Note: the schedule])."""
    return (1.0 - theta) * math.exp(-gamma * step) + theta


def keep_probabilities(num_layers: int, theta_t: float) -> tuple[float, ...]:
    """``p_l = 1 - (l / L) (1 - theta_t)`` for ``l = 1..L`` ([Note: the schedule])."""
    return tuple(1.0 - (l / num_layers) * (1.0 - theta_t) for l in range(1, num_layers + 1))


@dataclass(frozen=True)
class LayerDropPlan:
    """This batch's decision: which layers run, and the scale of their residual branches."""

    step: int
    theta: float
    keep_prob: tuple[float, ...]
    keep: tuple[bool, ...]
    scale_outputs: bool = True

    def scale(self, layer: int) -> Optional[float]:
        """Multiplier of a kept layer's residual branches (None: leave them alone, [Note: a dropped layer])."""
        p = self.keep_prob[layer]
        return None if not self.scale_outputs or p >= 1.0 else 1.0 / p

    @property
    def executed(self) -> int:
        return sum(self.keep)


@runtime_checkable
class SupportsLayerDrop(Protocol):
    """What a model offers :class:`ProgressiveLayerDrop`: how many droppable layers it has, and a place
    to receive each training batch's plan. Its forward, when training and holding a plan, skips
    layer ``l`` unless ``plan.keep[l]`` and scales a kept layer's residual branches by
    ``plan.scale(l)``; in evaluation it runs every layer (see ``examples/gpt.py``'s ``GPT``)."""

    def pld_num_layers(self) -> int: ...

    def set_layer_drop(self, plan: Optional[LayerDropPlan]) -> None: ...


def find_layer_drop_model(module: nn.Module) -> SupportsLayerDrop:
    """The first module (the LightningModule itself, then its submodules) implementing the protocol."""
    for m in module.modules():
        if isinstance(m, SupportsLayerDrop):
            return m
    raise TypeError(
        f"ProgressiveLayerDrop needs a model implementing SupportsLayerDrop (pld_num_layers() and "
        f"set_layer_drop(plan)); none found in {type(module).__name__}. The example GPT has it with model.pld=true."
    )


class ProgressiveLayerDrop(Callback):
    """Drops transformer layers on DeepSpeed's schedule ([Note: the schedule]).

    Args:
        theta: the keep ratio the schedule decays to (DeepSpeed's default 0.5; 1.0 never drops).
        gamma: how fast it decays per optimizer step (DeepSpeed's default 0.001).
        seed: seeds the private generator of the drop decisions ([Note: the same decision on every rank]).
        scale: scale a kept layer's residual branches by ``1 / p_l`` ([Note: a dropped layer]).
        log: log ``pld/theta`` and ``pld/executed_layers`` through ``LightningModule.log``.
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001, seed: int = 0, scale: bool = True, log: bool = True) -> None:
        super().__init__()
        if not 0.0 < theta <= 1.0:
            raise ValueError(f"theta must be in (0, 1], got {theta!r}.")
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma!r}.")
        self.theta = float(theta)
        self.gamma = float(gamma)
        self.seed = int(seed)
        self.scale = bool(scale)
        self.log = bool(log)
        self.plans: list[LayerDropPlan] = []
        """Every plan handed out this fit, in order (tests and reports read it)."""
        self._model: Optional[SupportsLayerDrop] = None

    def plan_for(self, step: int, batch_idx: int, num_layers: int) -> LayerDropPlan:
        """The decision for one batch: a function of (seed, step, batch index) only."""
        theta_t = theta_at(step, self.theta, self.gamma)
        probs = keep_probabilities(num_layers, theta_t)
        g = torch.Generator().manual_seed((self.seed * 0x9E37_79B9 + step * 1_000_003 + batch_idx) % 2**63)
        draws = torch.rand(num_layers, generator=g, dtype=torch.float64).tolist()
        keep = tuple(u < p for u, p in zip(draws, probs))
        return LayerDropPlan(step, theta_t, probs, keep, self.scale)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._model = find_layer_drop_model(pl_module)
        self.plans = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self._model is not None
        plan = self.plan_for(trainer.global_step, batch_idx, self._model.pld_num_layers())
        self.plans.append(plan)
        self._model.set_layer_drop(plan)
        if self.log:
            pl_module.log("pld/theta", plan.theta, on_step=True, on_epoch=False)
            pl_module.log("pld/executed_layers", float(plan.executed), on_step=True, on_epoch=False)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._model is not None:  # nothing outside a training batch sees a plan (validation runs all layers)
            self._model.set_layer_drop(None)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._model is not None:
            self._model.set_layer_drop(None)
        self._model = None


__all__ = [
    "ProgressiveLayerDrop", "LayerDropPlan", "SupportsLayerDrop", "theta_at", "keep_probabilities",
    "find_layer_drop_model",
]
