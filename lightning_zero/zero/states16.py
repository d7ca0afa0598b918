"""16-bit master weights and Adam states on the device (``state_precision``, stages 1-3 without offload).

[Note: 16-bit states on the device]
With ``state_precision='bf16_sr'`` or ``'bf16_kahan'`` each flat group's partition keeps, on the device:

=============  ==========================================================  ===========
precision      per element of this rank's partition                        bytes/param
=============  ==========================================================  ===========
``fp32``       fp32 master, fp32 exp_avg, fp32 exp_avg_sq (torch's Adam)   12
``bf16_sr``    bf16 master, bf16 exp_avg, bf16 exp_avg_sq                  6
``bf16_kahan`` bf16 master + bf16 compensation, bf16 exp_avg, exp_avg_sq   8
=============  ==========================================================  ===========

The math is the compact host states' (optim/host_states.py [Note: host state precisions] says why
stochastic rounding or a Kahan word, and why the moments are stochastically rounded in both), stepped by
optim/bf16_step.py with the same reference. What differs is where the state lives, and so what it can
share: the bf16 master *is* the compute weight (its high word, for Kahan), so stage 3 gathers straight
from it (the separate 16-bit partition disappears: 14 bytes per parameter of persistent partition
become 6 or 8), and stages 1-2 all-gather it as they gathered the cast of the fp32 master.

How it is built: the engine builds its groups as always (fp32 masters filled from the model's weights),
then :class:`DeviceStates16` converts each master once: the bf16 master is the fp32 value rounded to
nearest (stage 3: the 16-bit partition, which already holds exactly that), the Kahan word the remainder,
and the fp32 master is freed. The gradient shard stays fp32 (``grad_dtype``): reduced gradients are
accumulated over micro-batches exactly as with fp32 states; ``grad_shard_precision='bf16'`` halves it
(the reduction already runs in bf16, so only accumulation rounds differently). The step reads the
gradients with the unscale and clip coefficient folded into its ``grad_scale`` (no pass over them).

The state lives in ``optimizer.state[master]`` under torch's names (``step``, ``exp_avg``, ``exp_avg_sq``,
and ``master_comp`` for Kahan), so checkpoints save it as it is, per parameter, in bf16; LR schedulers
and param-group edits are read at each step (``adam_hyper``). Loading converts whatever layout the
checkpoint has into the run's (:func:`adapt_loaded_state`): moments cast, a Kahan word folded into the
master of a run without one, or started at zero in a Kahan run loading a checkpoint without one.

Random bits: element ``i`` of a flat group draws the bits of its flat index (the same index on every
world size for unpadded layouts), seeded by the group's index, so ranks and buckets never share bits
and any chunking gives the same result (optim/bf16_step.py [Note: one step, two places]). A parameter
that no rank used is not stepped (zero/unused.py), as under fp32 states.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_zero.config.state_precision import StatePrecisionConfig
from lightning_zero.offload.cpu import AdamHyper, adam_hyper
from lightning_zero.optim.bf16_step import bf16_adam_step
from lightning_zero.optim.step_hooks import refuse_step_hooks
from lightning_zero.zero.unused import GroupPlan

BYTES_PER_PARAM = {"fp32": 12, "bf16_sr": 6, "bf16_kahan": 8}
"""Device bytes per parameter of a partition's master and Adam moments (the Note's table)."""
COMP_KEY = "master_comp"
"""``optimizer.state`` key of the Kahan compensation (``bf16_kahan``)."""
_MOMENTS = ("exp_avg", "exp_avg_sq")


class DeviceStates16:
    """The bf16 layouts of an engine's flat groups and their step (see [Note: 16-bit states on the device])."""

    def __init__(self, cfg: StatePrecisionConfig, optimizer: torch.optim.Optimizer, groups: Sequence[Any],
                 pg_of: Sequence[int], compute_dtype: torch.dtype, stage: int) -> None:
        """Refuse what is not built, then convert every group's fp32 master (module docstring)."""
        self.precision = cfg.state_precision
        self.kahan = self.precision == "bf16_kahan"
        self.optimizer = optimizer
        self.groups = groups
        self.pg_of = list(pg_of)
        self.grad_dtype = torch.bfloat16 if cfg.grad_shard_precision == "bf16" else torch.float32
        """dtype of the reduced-gradient shards (``grad_shard_precision``)."""
        name = type(optimizer).__name__
        refuse_step_hooks(optimizer, f"state_precision={self.precision!r}")  # [Note: step hooks and steps torch never takes]
        if not all(adam_hyper(optimizer, pg) is not None for pg in optimizer.param_groups):
            raise ValueError(f"state_precision={self.precision!r} steps Adam/AdamW only (torch.optim.Adam/AdamW, "
                             f"without amsgrad/maximize/capturable/differentiable); got {name}: use "
                             "state_precision='fp32'.")
        if compute_dtype != torch.bfloat16:
            raise ValueError(f"state_precision={self.precision!r} keeps bf16 masters, which are the compute weights: "
                             f"it needs precision='bf16-mixed', not {compute_dtype} compute.")
        for fg in groups:
            self._convert(fg)
        rank_zero_info(
            f"lightning_zero: ZeRO-{stage} keeps master weights and Adam moments in {self.precision} on the device "
            f"({BYTES_PER_PARAM[self.precision]} bytes per parameter of each rank's partition instead of 12; "
            f"{'a Kahan compensation word; moments stochastically rounded' if self.kahan else 'stochastic rounding'}"
            f"); reduced gradients in {cfg.grad_shard_precision}."
        )

    # ---------------------------------------------------------------- construction
    def _convert(self, fg: Any) -> None:
        """fp32 master -> bf16 master (+ Kahan word); the fp32 master's storage is freed."""
        master32: Tensor = fg.master
        high = getattr(fg, "shard16", None)  # stage 3: the 16-bit partition is the fp32 master rounded to nearest
        if high is None or high.dtype != torch.bfloat16:
            high = master32.to(torch.bfloat16)
        else:
            fg.shard16 = None  # the master is the gather source now (sharded_group.py gather_source)
        fg.grad_dtype = self.grad_dtype  # module docstring
        if self.kahan:
            self.optimizer.state[high] = {COMP_KEY: (master32 - high.to(torch.float32)).to(torch.bfloat16)}
        fg.master = high
        self.optimizer.state.pop(master32, None)

    def _state(self, fg: Any) -> dict:
        """The group's state, created at its first step (moments zero)."""
        st = self.optimizer.state.setdefault(fg.master, {})
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32)
        for key in _MOMENTS + ((COMP_KEY,) if self.kahan else ()):
            if key not in st:
                st[key] = torch.zeros_like(fg.master)
        return st

    # ---------------------------------------------------------------- the step
    def step(self, grads: Sequence[Tensor], coef: float, plans: Optional[Sequence[Optional[GroupPlan]]]) -> None:
        """Adam on every group: ``grads`` (this rank's shards) times ``coef`` (unscale and clip), whole or
        under the unused-parameter ``plans`` (zero/unused.py)."""
        opt = self.optimizer
        for gi, (fg, grad) in enumerate(zip(self.groups, grads)):
            plan = plans[gi] if plans is not None else None
            if plan is not None and not plan.stepped:
                continue
            hyper = adam_hyper(opt, opt.param_groups[self.pg_of[gi]])
            assert hyper is not None  # checked at construction; a swapped optimizer class is not supported
            st = self._state(fg)
            if plan is None:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).cpu() + 1  # a loaded count: maybe a float
                ranges = [(0, fg.master.numel(), int(st["step"].item()))]
            else:
                st["step"] = torch.full((), float(plan.steps), dtype=torch.float32)
                ranges = plan.ranges
            for lo, hi, count in ranges:  # coef 0 (an infinite norm clipped, nonfinite='ignore'): g * 0, as fp32 states
                self._step_range(gi, fg, st, grad, lo, hi, count, hyper, 1.0 / coef if coef else math.inf)
        # what optimizer.step() would have recorded for LR schedulers (offload/engine.py [Note: the LR
        # scheduler sees the CPU step]; that module imports this one, so the flag is set here)
        setattr(opt, "_opt_called", True)

    def _step_range(self, gi: int, fg: Any, st: dict, grad: Tensor, lo: int, hi: int, count: int, hyper: AdamHyper,
                    grad_scale: float) -> None:
        """Step ``[lo, hi)`` of the partition, bucket chunk by bucket chunk (each chunk is contiguous in the
        flat buffer, so its elements draw the bits of their flat indices)."""
        comp = st.get(COMP_KEY)
        for a, z, flat in chunk_pieces(fg, lo, hi):
            bf16_adam_step(fg.master[a:z], None if comp is None else comp[a:z], grad[a:z], st["exp_avg"][a:z],
                           st["exp_avg_sq"][a:z], step=count, hyper=hyper, grad_scale=grad_scale, seed=gi,
                           offset=flat)

    def compensation(self, fg: Any) -> Optional[Tensor]:
        """``fg``'s Kahan words (``bf16_kahan``, after its first step), else None."""
        return self.optimizer.state.get(fg.master, {}).get(COMP_KEY)

    def adopt_param_writes(self) -> None:
        """Parameter changes made since the last step reach the bf16 masters (flat_group.py [Note: writes
        outside the optimizer]), before the step that would write the masters back over them."""
        for fg in self.groups:
            fg.adopt_param_writes(self.compensation(fg))

    def masters_replaced(self) -> None:
        """The masters were overwritten (weights loaded): Kahan words of the old values are dropped (zeroed)."""
        for fg in self.groups:
            comp = self.optimizer.state.get(fg.master, {}).get(COMP_KEY)
            if comp is not None:
                comp.zero_()

    # ---------------------------------------------------------------- inspection
    def state_tensors(self, fg: Any) -> list[Tensor]:
        """The master and every state tensor of a group (storage counts in tests and reports)."""
        st = self.optimizer.state.get(fg.master, {})
        return [fg.master] + [v for k, v in st.items() if k != "step" and torch.is_tensor(v)]


def chunk_pieces(fg: Any, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(start, end, flat index of start) of the pieces of partition range ``[lo, hi)``, one per bucket chunk."""
    shard = fg.shard if fg.layout.num_shards > 1 else 0
    out = []
    for b in fg.layout.buckets:
        a, z = max(lo, b.shard_offset), min(hi, b.shard_offset + b.chunk)
        if a < z:
            out.append((a, z, b.chunk_range(shard)[0] + a - b.shard_offset))
    return out


def adapt_loaded_state(engine: Any) -> None:
    """After an optimizer state was loaded (any checkpoint format, inside ``host_state``): bring it into
    this engine's layout. Moments take the master's dtype (bf16 states round to nearest, fp32 states widen
    exactly); a Kahan word is kept by a Kahan run, folded into the master by any other; a Kahan run
    loading a checkpoint without one starts it at zero. The 16-bit weights stay the checkpoint's: the
    master's high word, what the saving run computed with (no collective here)."""
    opt = engine.optimizer
    kahan = getattr(engine, "states16", None) is not None and engine.states16.kahan
    for fg in engine.groups:
        st = opt.state.get(fg.master)
        if not st:
            continue
        for key in _MOMENTS:
            v = st.get(key)
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() == fg.master.numel():
                st[key] = v.to(device=fg.master.device, dtype=fg.master.dtype)
        comp = st.pop(COMP_KEY, None)
        if comp is None:
            continue
        comp = comp.to(fg.master.device)
        if kahan:
            st[COMP_KEY] = comp.to(torch.bfloat16)
        else:
            fg.master.copy_(fg.master.to(torch.float32) + comp.to(torch.float32))
