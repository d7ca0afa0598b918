"""Stage 3's first training step: every rank must gather the same units in the same order.

[Note: units skipped in the first step]
Stage 3 records the order in which the first training step enters its units and prefetches along it
from then on; from the second step a unit skipped on some ranks only (a data-dependent branch, an
early exit) is caught up with along that order (stage3.py [Note: units skipped on one rank]) and trains
as under ddp. In the first step there is no order yet, so a rank that skips a unit issues its next
gather while the others still wait in the skipped unit's: the collectives mismatch and the step hangs
(or gloo fails on the sizes, naming nothing). So while the order is being recorded, each gather that
will issue a collective is preceded by a one-integer all-gather of the unit's index on the gather's
group: every rank reaches it at the same point of its program, and where the indices differ every rank
raises the same error, naming the units, instead of hanging. One tiny collective and one host read per
unit and direction, in the first step only.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lightning_zero.comm import collectives as C


def check_same_unit(index: int, units: Sequence[Any], group: Optional[C.ProcessGroup], device: torch.device,
                    where: str) -> None:
    """Raise on every rank of ``group`` if its ranks are about to gather different units (see the Note);
    ``units``: stage 3's units, by index (their names go into the error)."""
    n = C.world_size(group)
    if n == 1:
        return
    every = torch.empty(n, dtype=torch.int64, device=device)
    C.all_gather(every, torch.full((1,), index, dtype=torch.int64, device=device), group)
    seen = every.tolist()
    if len(set(seen)) > 1:
        ranks = "; ".join(f"rank {r} `{units[i].name}`" for r, i in enumerate(seen))
        raise RuntimeError(
            f"ZeRO-3: in the first training step the ranks entered different modules ({ranks}; this rank in its "
            f"{where}). "
            "Stage 3 records the first step's order of modules to gather their weights, so a module skipped on "
            "some ranks only (a data-dependent branch or early exit) must not be skipped in the first step: run "
            "every module on every rank in the first step (later steps may skip), or use stage 2 "
            "(lightning_zero/zero/first_step.py [Note: units skipped in the first step]).")
