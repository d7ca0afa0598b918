"""Ranks with different amounts of work: refused up front, on every rank, in one line.

[Note: uneven inputs]
Every training step pairs collectives across ranks (gradient reduce-scatters, stage 3's gathers, the
step's norm). When one rank's dataloader has 5 batches and another's 7, the rank with 5 ends its
epoch (or its fit: exit 0) while the other enters step 6 alone and dies in a collective with gloo's
"Connection closed by peer ... remote worker crashing" (Lightning's ``ddp`` does the same). We do not
train through uneven inputs (torch's ``Join``: the ranks that ran out would shadow every collective
of the others, with zero gradients, which also changes the averaged gradient): we stop every rank
before the first uneven step, with one sentence that says which rank runs out at which batch and how
to fix it.

How ranks learn it without a sync per step: at the first training batch of each epoch the ranks
exchange the number of batches Lightning will draw from their loaders this epoch
(``trainer.num_training_batches``: ``len(loader)`` after ``limit_train_batches``), one small
all-gather per epoch. From those numbers, the global step and ``max_steps`` (identical on every
rank) each rank decides the same thing at once: whether this epoch reaches a batch index some rank
does not have, or an optimizer step (the flush of a partial accumulation window at the shorter
rank's epoch end) that the others do not take. If ``max_steps`` ends the fit before that, nothing is
refused (the run is what ddp's would be). Loaders without a length (an ``IterableDataset``) cannot be
compared up front; they are not checked.

Evaluation under stage 3 (and pipeline parallelism) runs collectives in every forward (the unit
gathers), so a validation, test or predict loop of different lengths across ranks would hang or
crash the same way: its lengths are compared once when the loop starts, and differing lengths are
refused in one line. Stages 0-2 evaluate without collectives and are left alone, as under ddp.
A loop inside one step that runs a different number of forwards per rank (generation stopping early
on one rank) cannot be seen from the loaders: the stage-3 engine's gathers would mismatch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from lightning_zero.comm import collectives as C
from lightning_zero.failures import OneLineError

FIX = ("give every rank the same number of batches: keep Trainer(use_distributed_sampler=True) (the default), or use "
       "a DistributedSampler(..., drop_last=True) / equal-length per-rank loaders")


class UnevenInputsError(OneLineError):
    """Ranks would run different numbers of steps (or forwards under stage 3); raised on every rank."""


def _fmt(n: float) -> str:
    return "unknown" if math.isinf(n) else str(int(n))


def first_uneven_batch(lengths: Sequence[float], start: int, global_step: int, max_steps: int,
                       accumulate: int) -> Optional[int]:
    """The batch index of this epoch at which ranks with these loader lengths would stop pairing their
    collectives, or None if the epoch (bounded by ``max_steps``) never gets there. ``start``: the first
    batch index of this epoch that runs here (a resumed epoch starts mid-way)."""
    short, long_ = min(lengths), max(lengths)
    if short == long_ or math.isinf(short):
        return None
    short = int(short)
    # the shorter rank flushes a partial accumulation window at its epoch's end; the longer ones do not
    flush = short % accumulate != 0
    cut = (short // accumulate) * accumulate if flush else short
    steps_before_cut = cut // accumulate - start // accumulate
    if max_steps >= 0 and global_step + steps_before_cut >= max_steps:
        return None  # the fit ends before the ranks part: every rank stops at the same step, as under ddp
    return max(cut, start)


def check_training_epoch(lengths: Sequence[float], epoch: int, start: int, global_step: int, max_steps: int,
                         accumulate: int) -> None:
    """Raise :class:`UnevenInputsError` (on every rank alike) when this epoch would part the ranks."""
    at = first_uneven_batch(lengths, start, global_step, max_steps, accumulate)
    if at is None:
        return
    short = min(range(len(lengths)), key=lambda r: lengths[r])
    counts = ", ".join(f"rank {r}: {_fmt(n)}" for r, n in enumerate(lengths))
    raise UnevenInputsError(
        f"uneven inputs: rank {short} runs out of training batches at batch {int(lengths[short])} of epoch {epoch} "
        f"while other ranks have more ({counts} batches this epoch); every step's collectives pair across ranks, "
        f"so training would stop at batch {at} with a hang or a crash in a collective. Fix: {FIX}.")


def gather_lengths(n: float) -> list[float]:
    """Every rank's number of batches (one all-gather of a float)."""
    return [float(x) for x in C.all_gather_object(float(n), None)]  # type: ignore[arg-type]


def check_eval_lengths(kind: str, mine: Sequence[float]) -> None:
    """Evaluation with collectives in every forward (stage 3, pipeline): refuse loops of different lengths."""
    got = C.all_gather_object([float(n) for n in mine], None)
    if all(list(g) == list(got[0]) for g in got):  # type: ignore[call-overload]
        return
    counts = ", ".join(f"rank {r}: {'+'.join(_fmt(n) for n in g)}" for r, g in enumerate(got))  # type: ignore[attr-defined]
    raise UnevenInputsError(
        f"uneven inputs: the {kind} loop has a different number of batches per rank ({counts}); under ZeRO stage 3 "
        f"every forward gathers parameters across ranks, so the rank with fewer batches would leave the others "
        f"waiting in a collective. Fix: {FIX} (Lightning's DistributedSampler pads evaluation sets to equal "
        f"lengths).")


__all__ = ["UnevenInputsError", "check_eval_lengths", "check_training_epoch", "first_uneven_batch", "gather_lengths"]
