"""OneBitLamb: LAMB whose momentum, after a warm-up, is averaged with a 1-bit error-compensated all-reduce.

1-bit LAMB (Li et al., 2021; DeepSpeed's ``OnebitLamb``). Warm-up: exact LAMB (the math of
``lightning_zero.optim.reference.lamb_step_reference``), while an exponential average of each
tensor's trust ratio is kept. Compression phase, per tensor:

* the variance ``v`` is frozen; the momentum, updated with the local gradient, is scaled by a
  per-tensor ``scaling_coeff`` (fixed at the first compressed step, so every tensor's momentum has
  the same RMS: the compressor's scales then fit all tensors alike), averaged by the 1-bit
  all-reduce, and unscaled;
* a *fresh* variance ``v_fresh`` keeps tracking gradients reconstructed from the averaged momentum,
  ``g = (m_t - beta1 m_{t-1}) / (1 - beta1)``;
* the trust ratio is the frozen average ratio times a ``factor = max(denom_frozen / denom_fresh)``
  that says how far the frozen preconditioner has drifted, clamped to [factor_min, factor_max] and
  to within ``factor_threshold`` of its previous value (stability).

The per-tensor statistics (ratio average, last factor, scaling) live outside ``self.state`` (they
are per tensor, not per element; see [Note: flat parameters and segments] in ``_onebit.py``) and go
into checkpoints with the communication state. Bias correction is applied as in LAMB
(``bias_correction=True``); DeepSpeed's 1-bit LAMB applies none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm.compressed.backend import CompressedBackend
from lightning_zero.optim._common import check_hyper
from lightning_zero.optim._onebit import OneBitOptimizer, bias_corrections


@dataclass
class _TensorStats:
    """Per-tensor (per segment) statistics of one parameter."""

    coeff_avg: Tensor
    """Exponential average of the warm-up trust ratios (DeepSpeed's ``lamb_coeff_freeze``)."""
    last_factor: Tensor
    scaling: Optional[Tensor] = None
    """Momentum scaling of the compression phase (set at its first step)."""

    def to_saved(self) -> dict[str, Optional[Tensor]]:
        return {k: None if v is None else v.detach().cpu().clone() for k, v in vars(self).items()}


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB.

    Args:
        params: tensors or param groups.
        lr, betas, eps, weight_decay, bias_correction, max_coeff, min_coeff: as FusedLamb.
        freeze_step: exact LAMB steps (with full-precision gradient averaging) before compression.
        coeff_beta: decay of the average of warm-up trust ratios.
        factor_max, factor_min, factor_threshold: bounds of the compression-phase ratio factor.
        comm_backend, checkpoint_errors: as OneBitAdam.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100_000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        comm_backend: Optional[CompressedBackend] = None,
        checkpoint_errors: bool = True,
    ) -> None:
        betas = (float(betas[0]), float(betas[1]))
        check_hyper(lr, betas, eps, weight_decay)
        if min_coeff > max_coeff or factor_min > factor_max or not 0.0 <= coeff_beta < 1.0 or factor_threshold < 0:
            raise ValueError(
                f"invalid LAMB bounds min_coeff={min_coeff} max_coeff={max_coeff} factor_min={factor_min} "
                f"factor_max={factor_max} coeff_beta={coeff_beta} factor_threshold={factor_threshold}"
            )
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            max_coeff=max_coeff, min_coeff=min_coeff,
        )  # fmt: skip
        super().__init__(
            params, defaults, freeze_step=freeze_step, comm_backend=comm_backend, checkpoint_errors=checkpoint_errors
        )
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self._stats: dict[int, _TensorStats] = {}
        """By parameter index (optimizer order)."""

    # ------------------------------------------------------------------ per-tensor statistics
    def _stats_for(self, index: int, p: Tensor) -> _TensorStats:
        n = len(self.segments_of(p))
        st = self._stats.get(index)
        if st is None or st.coeff_avg.numel() != n:
            st = _TensorStats(torch.zeros(n, device=p.device), torch.ones(n, device=p.device))
            self._stats[index] = st
        return st

    def _extra_state(self) -> dict[str, Any]:
        return {"tensor_stats": {i: st.to_saved() for i, st in self._stats.items()}}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        params = self._params()
        self._stats = {}
        for key, saved in (extra.get("tensor_stats") or {}).items():
            index = int(key)
            p = params[index][2] if index < len(params) else None
            if p is None or saved["coeff_avg"].numel() != len(self.segments_of(p)):
                raise ValueError(
                    "OneBitLamb checkpoint: per-tensor statistics do not match this model's tensors "
                    "(a checkpoint from a different model or parameter layout)."
                )
            moved = {k: None if v is None else v.to(p.device) for k, v in saved.items()}
            self._stats[index] = _TensorStats(**moved)

    # ------------------------------------------------------------------ the two phases
    def _bias(self, group: dict[str, Any], step: int, variance_step: int) -> tuple[float, float]:
        beta1, beta2 = group["betas"]
        return bias_corrections(beta1, beta2, step, variance_step, group["bias_correction"])

    def _warmup_update(self, index: int, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        step = int(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1, bc2 = self._bias(group, step, step)
        update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
        if group["weight_decay"] != 0:
            update = update + group["weight_decay"] * p
        seg = self.segments_of(p)
        w_norm, u_norm = seg.norms(p.view(-1)), seg.norms(update.view(-1))
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        ratio = ratio.clamp(group["min_coeff"], group["max_coeff"])
        p.sub_((group["lr"] * seg.expand(ratio, 0.0)).view_as(p) * update)
        st = self._stats_for(index, p)
        beta = self.coeff_beta
        st.coeff_avg = torch.where(ratio != 1.0, beta * st.coeff_avg + (1 - beta) * ratio, st.coeff_avg)
        if step == self.freeze_step:
            state["exp_avg_sq_fresh"] = v.clone()

    def _before_compressed_step(self, params: list[tuple[int, dict[str, Any], Tensor]]) -> None:
        """First compressed step: one momentum scaling per tensor, to a common RMS over all tensors."""
        todo = [(i, p) for i, _, p in params if p in self.state and self._stats_for(i, p).scaling is None]
        if not todo:
            return
        rms = {}
        for i, p in todo:
            seg = self.segments_of(p)
            lengths = torch.tensor([n for _, n in seg.spans], dtype=torch.float32, device=p.device)
            rms[i] = seg.norms(self.state[p]["exp_avg"].view(-1)).float() / lengths.sqrt()
        united = torch.cat([r.to(todo[0][1].device) for r in rms.values()]).mean()
        for i, p in todo:
            r = rms[i]
            self._stats[i].scaling = torch.where(r > 0, united.to(r.device) / r, torch.ones_like(r))

    def _compressed_update(self, index: int, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        step = int(state["step"])
        seg = self.segments_of(p)
        st = self._stats_for(index, p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if "exp_avg_sq_fresh" not in state:
            state["exp_avg_sq_fresh"] = v.clone()
        v_fresh = state["exp_avg_sq_fresh"]
        m_last = m.clone()
        m.mul_(beta1).add_(grad, alpha=1 - beta1)  # local gradient: nobody averaged it
        if st.scaling is None:
            self._before_compressed_step([(index, group, p)])
        assert st.scaling is not None
        scaling = seg.expand(st.scaling, 1.0).view_as(m)
        m.mul_(scaling)
        self.average_momentum_(index, m)
        m.div_(scaling)
        seg.zero_gaps_(m.view(-1))
        g = (m - m_last * beta1) / (1 - beta1)
        v_fresh.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2_frozen = self._bias(group, step, self.freeze_step)
        bc2_fresh = self._bias(group, step, step)[1]
        denom = (v / bc2_frozen).sqrt() + group["eps"]
        update_prelim = (m / bc1) / denom
        wd = group["weight_decay"]
        update = update_prelim + wd * p if wd != 0 else update_prelim
        denom_fresh = (v_fresh / bc2_fresh).sqrt() + group["eps"]
        factor = seg.maxima((denom / denom_fresh).view(-1))
        if wd != 0:
            u_norm = seg.norms(update.view(-1))
            prelim_norm = seg.norms(update_prelim.view(-1))
            share = torch.where(u_norm > 0, (prelim_norm / u_norm).clamp(max=1.0), torch.ones_like(u_norm))
            factor = factor * share + (1.0 - share)
        factor = factor.clamp(self.factor_min, self.factor_max)
        last = st.last_factor
        thr = self.factor_threshold
        factor = torch.minimum(torch.maximum(factor, last * (1.0 - thr)), last * (1.0 + thr))
        st.last_factor = factor
        ratio = st.coeff_avg * factor
        p.sub_((group["lr"] * seg.expand(ratio, 0.0)).view_as(p) * update)
