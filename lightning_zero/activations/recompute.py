"""What a region recomputed in backward must not do a second time (activation checkpointing of any kind:
offload.py's, the pipeline's segments).

torch's checkpoint replays a region's forward to rebuild what backward needs; state the forward changes in
place changes again. Two kinds reach users' models through our checkpointing: an HF decoder layer's
key/value cache and batch norms' running statistics (the Notes below). Dropout needs nothing here: the
checkpoint replays the random state.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword names HF decoder layers take their key/value cache by (``cache`` from transformers 5.x, the others
before); only a value with HF's cache API (``get_seq_length``) is taken for one."""


def without_kv_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """[Note: no key/value cache in a recomputed region] ``kwargs`` with an HF key/value cache dropped.

    An HF decoder layer appends this step's keys and values to the cache it is given (``use_cache=True``,
    HF's default even in training). Recomputed in backward, the layer appends them a second time and
    attends over both copies: under sequence parallelism that trained silently differently from the run
    without offload (Ulysses; found 2026-11-29 on an HF Llama at SP 2) or failed the recomputation's shape
    check (ring attention), and with a mask built for the original length it cannot run at all. Training
    never reads the cache, and HF's own gradient checkpointing turns ``use_cache`` off for the same reason,
    so a checkpointed region runs without it while gradients are recorded (with one warning); evaluation
    and generation (no gradients) keep it."""
    cached = [k for k in CACHE_KWARGS if hasattr(kwargs.get(k), "get_seq_length")]
    if not cached:
        return kwargs
    warnings.warn(f"activation checkpointing runs each checkpointed layer twice; its key/value cache "
                  f"({cached[0]}) would take the keys twice: the checkpointed layers run without it while "
                  "training, as HF's gradient checkpointing does with use_cache=False", stacklevel=3)
    out = {k: (None if k in cached else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def running_stats(*modules: Optional[nn.Module]) -> list[Tensor]:
    """The buffers a forward in training mode updates in place: batch norms' running statistics."""
    norms = [m for module in modules if module is not None for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats]
    return [b for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


def recompute_keeps_stats(*modules: Optional[nn.Module]) -> dict[str, Any]:
    """Keyword arguments for torch's non-reentrant ``checkpoint`` of a region running ``modules``: a
    ``context_fn`` that restores their running statistics after the recomputation (see the Note of
    :func:`_kept`), or nothing when they hold none."""
    stats = running_stats(*modules)
    return {"context_fn": lambda: (contextlib.nullcontext(), _kept(stats))} if stats else {}


@contextlib.contextmanager
def _kept(buffers: list[Tensor]) -> Iterator[None]:
    """[Note: running statistics in a recomputed region] Restore ``buffers`` after the recomputation.

    A batch norm in training mode normalises with the batch's statistics and folds them into its running
    statistics. Recomputed in backward it would fold them in a second time (``num_batches_tracked`` 2 per
    step where ddp has 1, the running mean and variance moved twice: what evaluation then uses), so the
    checkpointed module's running statistics are put back as they were when its recomputation began. The
    recomputed outputs are unchanged (they use the batch's statistics, not the running ones). Only for
    modules checkpointed in the module form: a wrapped function's norms are not known."""
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
