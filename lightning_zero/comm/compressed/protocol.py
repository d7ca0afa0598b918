"""How a strategy talks to an optimizer that does its own (compressed) communication.

An optimizer opts in with the class attribute ``uses_compressed_comm = True`` and implements
:class:`CompressedCommOptimizer`. The strategy then, and only then:

1. checks the ZeRO stage against ``supported_zero_stages`` before training (:func:`attach_backend`),
   and hands the optimizer a backend over the data-parallel group (dependency passed in: the
   optimizer never sees the strategy);
2. before each step's last backward, asks ``needs_gradient_allreduce()`` and switches the engine's
   gradient all-reduce off while the optimizer averages momentum itself
   (:func:`gradient_allreduce_needed`);
3. adds the optimizer's per-rank communication state to checkpoints (:func:`add_comm_state`,
   a collective) and gives it back on load (:func:`restore_comm_state`).

These helpers are no-ops for every other optimizer, so the strategy calls them unconditionally.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed.backend import CompressedBackend, TorchDistBackend

COMM_STATE_KEY = "compressed_comm"
"""Key of the optimizer's communication state inside a checkpoint's optimizer state dict."""


@runtime_checkable
class CompressedCommOptimizer(Protocol):
    """The optimizer side of the contract (OneBitAdam and OneBitLamb implement it)."""

    uses_compressed_comm: bool
    supported_zero_stages: tuple[int, ...]

    def set_comm_backend(self, backend: CompressedBackend) -> None: ...

    def needs_gradient_allreduce(self) -> bool: ...

    def gather_comm_state(self) -> Optional[dict[str, Any]]: ...

    def load_comm_state(self, state: Optional[dict[str, Any]]) -> None: ...

    @property
    def comm_stats(self) -> dict[str, float]: ...


def uses_compressed_comm(optimizer: object) -> bool:
    return bool(getattr(optimizer, "uses_compressed_comm", False))


def attach_backend(optimizer: object, stage: int, dp_group: Optional[C.ProcessGroup]) -> None:
    """Hand a compressed optimizer its backend, or fail (before training) on a stage it cannot use."""
    if not uses_compressed_comm(optimizer):
        return
    supported = tuple(getattr(optimizer, "supported_zero_stages", (0,)))
    if stage not in supported:
        name = type(optimizer).__name__
        raise ValueError(
            f"{name} averages momentum with compressed communication, which works with ZeRO stage(s) "
            f"{list(supported)} only, got stage {stage}. Use ZeroStrategy(stage={supported[0]}) "
            f"(strategy='zero{supported[0]}'), or a plain optimizer with stage {stage}."
        )
    optimizer.set_comm_backend(TorchDistBackend(dp_group))  # type: ignore[attr-defined]


def gradient_allreduce_needed(optimizer: object) -> bool:
    """False while a compressed optimizer averages momentum itself (its compression phase)."""
    if not uses_compressed_comm(optimizer):
        return True
    return bool(optimizer.needs_gradient_allreduce())  # type: ignore[attr-defined]


def add_comm_state(optimizer: object, state: dict[str, Any]) -> dict[str, Any]:
    """Add the per-rank communication state to ``state`` (collective: every rank must call it)."""
    if uses_compressed_comm(optimizer):
        state[COMM_STATE_KEY] = optimizer.gather_comm_state()  # type: ignore[attr-defined]
    return state


def local_comm_state(optimizer: object) -> Optional[dict[str, Any]]:
    """This rank's communication state (no collective; sharded checkpoints store one per rank), or
    None for an optimizer without compressed communication."""
    if uses_compressed_comm(optimizer):
        return optimizer.local_comm_state()  # type: ignore[attr-defined]
    return None


def restore_comm_state(optimizer: object, state: dict[str, Any]) -> None:
    if uses_compressed_comm(optimizer):
        optimizer.load_comm_state(state.get(COMM_STATE_KEY))  # type: ignore[attr-defined]
