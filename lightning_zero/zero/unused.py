"""Parameters that no rank used in a step are not stepped, as torch's optimizers leave a ``grad=None`` one.

[Note: parameters unused on every rank]
A model with data-dependent control flow (a block or a side layer skipped on some steps) leaves some
parameters without a gradient. torch's optimizers skip a parameter whose ``.grad`` is None (no moment
update, no weight decay, no ``step`` count: AdamW keeps one per parameter), and ddp with
``find_unused_parameters=True`` leaves ``.grad`` None when no rank used the parameter; when some rank
used it, every rank gets the average (unused ranks contribute zeros). Our flat masters are stepped as
one tensor, so a parameter with no gradient used to be stepped with a zero gradient (DeepSpeed's
behaviour): with AdamW its moments decayed and weight decay shrank it, and training left ddp's path.

So the engine records, per parameter, whether its gradient hook fired since the last step (any
micro-batch of an accumulation window counts), and at the step all-reduces that mask (MAX) over each
group's ranks: one small collective per step, issued unconditionally so that every rank agrees.
The reduction is read on the host (one synchronisation under NCCL; the step after it is planned on
the host). Then, per flat group:

- every parameter used and none ever skipped: the master is stepped whole, as before (no cost);
- no parameter used on any rank: the group is not stepped at all (torch steps nothing either);
- otherwise the master is stepped as views of the used pieces of this rank's shard, each with its
  own step count (``optimizer.state`` gets views of the flat state for the step, and a per-view
  ``step``); unused pieces, their moments and every other state element stay bit for bit unchanged.
  A parameter that once missed a step keeps a lower count from then on, so such a group stays on this
  path (a few views per step) for the rest of the run.

The per-parameter lag is engine state; the flat state's ``step`` is the group's count (the most-stepped
parameter's), and checkpoints carry each parameter's own count, as torch's do (state_dict.py [Note:
per-parameter step counts in checkpoints]). Optimizers whose update couples elements of a tensor
(LAMB's trust ratio) or that exchange compressed momentum (1-bit) cannot step a subset, and stop with
one clear line the first time a parameter goes unused on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C


@dataclass
class GroupPlan:
    """How one flat group steps this time (shard coordinates)."""

    ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """(lo, hi, step count after this step) of the used pieces of this rank's shard, merged."""
    kept: list[tuple[int, int]] = field(default_factory=list)
    """(lo, hi) of the pieces of parameters no rank used: not stepped."""
    stepped: bool = True
    """Some rank used some parameter of the group (every rank agrees)."""
    steps: int = 0
    """The group's step count after this step (its flat state's ``step``)."""


def _refuse(optimizer: torch.optim.Optimizer) -> Optional[str]:
    if hasattr(optimizer, "bind_flat_params") or getattr(optimizer, "uses_compressed_comm", False):
        return (f"{type(optimizer).__name__} cannot leave parameters unused on every rank unstepped (its update couples "
                "the elements of a tensor or exchanges compressed momentum), and a parameter got no gradient on any "
                "rank in this step: use every parameter in every step, or AdamW/Adam/SGD.")
    if any(pg.get("momentum") and pg.get("dampening") for pg in optimizer.param_groups):
        return (f"{type(optimizer).__name__} with momentum and dampening starts a parameter's momentum from its first "
                "gradient, which a parameter unused on every rank in this step would only get later, inside a flat "
                "buffer whose momentum already exists: set dampening=0, or use every parameter in every step.")
    return None


class UsedParams:
    """Which parameters received a gradient since the last step, and how far each lags its group's step count."""

    def __init__(self, groups: Sequence, comms: Sequence) -> None:
        self.groups = groups
        self.comms = comms
        self.used = [bytearray(len(fg.params)) for fg in groups]
        self.lag = [[0] * len(fg.params) for fg in groups]
        self.lagging = [False] * len(groups)
        self.steps: list[Optional[int]] = [None] * len(groups)
        """Group ``gi``'s step count (read from its flat state at the first masked step)."""
        self.last: Optional[list[list[int]]] = None
        """The last step's reduced mask (what got a gradient on some rank, or kept one)."""
        self.kept: Optional[list[list[int]]] = None
        """Parameters whose gradient torch would hold as zeros, not None (see [Note: zero_grad(set_to_none=False)])."""

    def mark(self, gi: int, index: int) -> None:
        self.used[gi][index] = 1

    def keep_grads(self, keep: bool) -> None:
        """[Note: zero_grad(set_to_none=False)] torch zeroes a gradient in place instead of dropping it, so a
        parameter that once got one keeps a zero gradient, and torch's optimizers step it in every later step
        (AdamW decays it, momentum moves it), used or not; ddp leaves that zero tensor to the optimizer too.
        The optimizer's ``zero_grad(set_to_none=False)`` therefore makes every parameter some rank has used
        count as used from then on; ``set_to_none=True`` drops them again, as torch does."""
        self.kept = self.last if keep else None

    def restore_lags(self, gi: int, lags: list[int]) -> None:
        """A checkpoint gave group ``gi``'s parameters these lags behind its count (state_dict.py [Note:
        per-parameter step counts in checkpoints]); the count is read again from the loaded flat state."""
        self.lag[gi] = list(lags)
        self.lagging[gi] = any(lags)
        self.steps[gi] = None

    def reset(self) -> None:
        for u in self.used:
            u[:] = bytes(len(u))

    def _reduce(self, device: torch.device) -> list[list[int]]:
        """Every group's mask, MAX over its ranks: one all-reduce per distinct group of ranks."""
        out: list[list[int]] = [list(u) for u in self.used]
        by_group: dict[int, list[int]] = {}
        for gi, comm in enumerate(self.comms):
            if comm.size > 1:
                by_group.setdefault(id(comm.group), []).append(gi)
        for gis in by_group.values():  # dict order: first appearance, the same on every rank
            group = self.comms[gis[0]].group
            flat = [v for gi in gis for v in self.used[gi]]
            mask = torch.tensor(flat, dtype=torch.uint8, device=C.device_for(group, device))
            C.all_reduce(mask, group, "max")
            values = mask.tolist()
            pos = 0
            for gi in gis:
                n = len(self.used[gi])
                out[gi] = values[pos : pos + n]
                pos += n
        return out

    def plan(self, optimizer: torch.optim.Optimizer, device: torch.device,
             counted: bool = False) -> Optional[list[Optional[GroupPlan]]]:
        """Collective: the step's plan per group (None: step the master whole), or None when every group
        steps whole (every parameter used somewhere, none lagging). Updates the lags. ``counted``: the
        flat states' ``step`` already counts this step (offload's step during backward)."""
        mask = self._reduce(device)
        if self.kept is not None:  # [Note: zero_grad(set_to_none=False)]
            mask = [[a or b for a, b in zip(m, k)] for m, k in zip(mask, self.kept)]
        self.last = mask
        if all(all(m) for m in mask) and not any(self.lagging):
            return None
        why = _refuse(optimizer)
        if why is not None and any(not all(m) for m in mask):
            raise RuntimeError(why)
        plans: list[Optional[GroupPlan]] = []
        for gi, (fg, m) in enumerate(zip(self.groups, mask)):
            if all(m) and not self.lagging[gi]:
                plans.append(None)
                continue
            if self.steps[gi] is None:
                st = optimizer.state.get(fg.master, {})
                self.steps[gi] = int(st["step"]) - int(counted) if torch.is_tensor(st.get("step")) else 0
            if not any(m):
                plans.append(GroupPlan(stepped=False, steps=self.steps[gi]))  # type: ignore[arg-type]
                for i in range(len(m)):
                    self.lag[gi][i] += 1
                self.lagging[gi] = True
                continue
            self.steps[gi] += 1  # type: ignore[operator]
            plans.append(self._group_plan(gi, fg, m))
        return plans

    def _group_plan(self, gi: int, fg: object, used: list[int]) -> GroupPlan:
        plan = GroupPlan(steps=self.steps[gi])  # type: ignore[arg-type]
        layout = fg.layout  # type: ignore[attr-defined]
        shard = fg.shard if layout.num_shards > 1 else 0  # type: ignore[attr-defined]
        lag = self.lag[gi]
        for index, _, lo, n in sorted(layout.param_pieces_in_shard(shard), key=lambda t: t[2]):
            if not used[index]:
                plan.kept.append((lo, lo + n))
                continue
            count = self.steps[gi] - lag[index]  # type: ignore[operator]
            last = plan.ranges[-1] if plan.ranges else None
            # merge over padding (zero gradients: stepping it changes nothing), never over a kept piece
            if last is not None and last[2] == count and not (plan.kept and plan.kept[-1][0] >= last[1]):
                plan.ranges[-1] = (last[0], lo + n, count)
            else:
                plan.ranges.append((lo, lo + n, count))
        for i, u in enumerate(used):
            if not u:
                lag[i] += 1
                self.lagging[gi] = True
        return plan


def _per_element(value: object, master: Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == master.numel()  # type: ignore[union-attr]


@contextmanager
def planned_masters(optimizer: torch.optim.Optimizer, masters: Sequence[Tensor], pg_of: Sequence[int],
                    grads: Sequence[Tensor], plans: Sequence[Optional[GroupPlan]]) -> Generator[None, None, None]:
    """Each param group lists, for the block, what its flat groups step under ``plans``: the master (plan
    None), nothing (nothing used), or views of the used pieces with views of the flat state and their own
    ``step``; afterwards the views' states are folded back into the flat state (created if the optimizer
    made it lazily for the views). See [Note: parameters unused on every rank]."""
    groups = optimizer.param_groups
    saved = [pg["params"] for pg in groups]
    lists: list[list[Tensor]] = [[] for _ in groups]
    views: list[tuple[int, Tensor, int, int]] = []  # (gi, view, lo, hi)
    counts: dict[int, int] = {}
    for gi, (master, g, plan) in enumerate(zip(masters, grads, plans)):
        if plan is None:
            master.grad = g
            lists[pg_of[gi]].append(master)
            continue
        flat = optimizer.state.get(master)
        for lo, hi, count in plan.ranges:
            v = master[lo:hi]
            v.grad = g[lo:hi]
            if flat:
                st: dict = {}
                for k, val in flat.items():
                    if _per_element(val, master):
                        st[k] = val[lo:hi]
                    elif k == "step" and torch.is_tensor(val):
                        st[k] = torch.full_like(val, count - 1)
                    elif torch.is_tensor(val):
                        raise RuntimeError(f"{type(optimizer).__name__} keeps a per-tensor state '{k}': it cannot step "
                                           "a subset of a flat group, and a parameter got no gradient on any rank.")
                    else:
                        st[k] = val
                optimizer.state[v] = st
            lists[pg_of[gi]].append(v)
            views.append((gi, v, lo, hi))
            counts[gi] = count
    for pg, params in zip(groups, lists):
        pg["params"] = params
    try:
        yield
    finally:
        for pg, params in zip(groups, saved):
            pg["params"] = params
        steps: dict[int, Tensor] = {}
        for gi, v, lo, hi in views:
            st = optimizer.state.pop(v, {})
            v.grad = None
            master = masters[gi]
            flat = optimizer.state[master]
            for k, val in st.items():
                if torch.is_tensor(val) and val.dim() == 1 and val.numel() == hi - lo:
                    if k not in flat:
                        flat[k] = torch.zeros(master.numel(), dtype=val.dtype, device=val.device)
                    dst = flat[k][lo:hi]
                    if dst.data_ptr() != val.data_ptr():
                        dst.copy_(val)
                elif k == "step" and torch.is_tensor(val):
                    steps[gi] = val
                elif k not in flat:
                    flat[k] = val
        for gi, master in enumerate(masters):
            if plans[gi] is None:
                master.grad = None
        for gi, val in steps.items():
            optimizer.state[masters[gi]]["step"] = val  # the caller sets the group's count (set_group_steps)


def set_group_steps(optimizer: torch.optim.Optimizer, masters: Sequence[Tensor],
                    plans: Sequence[Optional[GroupPlan]]) -> None:
    """The flat state's ``step`` is the group's count (see the Note), whatever piece stepped last."""
    for master, plan in zip(masters, plans):
        st = optimizer.state.get(master)
        if plan is not None and st and torch.is_tensor(st.get("step")):
            st["step"] = torch.full_like(st["step"], plan.steps)
