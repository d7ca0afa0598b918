"""What a region recomputed in backward must not do a second time (activation checkpointing of any kind:
offload.py's, the pipeline's segments).

torch's checkpoint replays a region's forward to rebuild what backward needs; state the forward changes in
place changes again. What reaches users' models through our checkpointing: an HF decoder layer's key/value
cache, which a training step never reads (dropped), and buffers (replayed: batch norms' running statistics,
spectral norm's power iteration); the Notes below. Dropout needs nothing here: the checkpoint replays the
random state.
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


REPLAY_MAX_BYTES = 1 << 20
"""Buffers up to this size are copied when a checkpointed forward starts, so that one the forward changes can be
replayed; a larger one that changes is refused (:class:`_Replay`)."""


def _untracked(module: nn.Module) -> list[Tensor]:
    """Buffers a training forward changes without bumping their version counter: batch norms' running mean and
    variance (updated inside the kernel). Every other in-place change bumps it."""
    return [b for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.training
            and m.track_running_stats for b in (m.running_mean, m.running_var) if b is not None]


def replay_buffers(*modules: Optional[nn.Module]) -> dict[str, Any]:
    """Keyword arguments for torch's non-reentrant ``checkpoint`` of a region running ``modules``: a
    ``context_fn`` that replays the buffers the forward changed ([Note: buffers in a recomputed region]), or
    nothing when the modules hold no buffer."""
    present = [m for m in modules if m is not None]
    buffers = list({id(b): b for m in present for b in m.buffers()}.values())
    if not buffers:
        return {}

    def context_fn() -> tuple[Any, Any]:
        replay = _Replay(buffers, {id(b) for m in present for b in _untracked(m)}, present)
        return replay.forward(), replay.recompute()

    return {"context_fn": context_fn}


class _Replay:
    """[Note: buffers in a recomputed region] One checkpointed call's buffers, from its forward to its
    recomputation.

    torch's checkpoint replays a region's forward in backward; a buffer the forward changed in place is
    changed again, from its new value. A batch norm in training mode folded its batch's statistics into its
    running statistics twice (``num_batches_tracked`` 2 per step where ddp has 1, the running mean and
    variance moved twice: what evaluation then uses); spectral norm's power iteration ran twice, so the
    recomputed weight was not the forward's and the gradients were wrong (both found 2026-11-29, both silent).
    So: when the forward starts, every buffer up to :data:`REPLAY_MAX_BYTES` is copied; when it ends, the
    copies of buffers it did not change are dropped (a changed buffer is one whose version counter moved, and
    batch norms' running mean and variance in training mode, which the kernel updates without it). The
    recomputation starts from the kept copies, the forward's own starting state, and afterwards every such
    buffer is put back as the forward left it. A larger buffer the forward changed cannot be replayed and is
    refused, naming it. Host-side bookkeeping only: no device synchronisation."""

    def __init__(self, buffers: list[Tensor], untracked: set[int], modules: list[nn.Module]) -> None:
        self.buffers, self.untracked, self.modules = buffers, untracked, modules
        self.before: list[tuple[Tensor, Tensor]] = []
        """(buffer, its value when the forward started), for the buffers the forward changed."""

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        start = [(b, b._version, b.clone() if b.numel() * b.element_size() <= REPLAY_MAX_BYTES else None)
                 for b in self.buffers]
        yield
        for b, version, copy in start:
            if b._version == version and id(b) not in self.untracked:
                continue
            if copy is None:
                raise RuntimeError(
                    f"{self._name(b)} ({b.numel() * b.element_size() >> 20} MiB) changed in "
                    "the forward of a checkpointed module: recomputing it in backward would start from the changed "
                    "value. Leave this module out of activation checkpointing (activation_offload_policy).")
            self.before.append((b, copy))

    def _name(self, buffer: Tensor) -> str:
        """``Module.buffer`` for the refusal (looked up only then: forwards do not pay for the names)."""
        return next((f"{type(m).__name__}.{n}" for m in self.modules for n, b in m.named_buffers() if b is buffer),
                    "a buffer")

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        after = [(b, b.clone()) for b, _ in self.before]
        with torch.no_grad():
            for b, copy in self.before:
                b.copy_(copy)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, copy in after:
                    b.copy_(copy)
