"""What a module whose ZeRO-3 parameters are released refuses outside the strategy, with the fix named.

[Note: released modules refuse, they do not return empty tensors]
A released stage-3 parameter keeps its shape but its storage has no bytes (sharded_group.py). Anything that reads
it outside a gather gets no values, and some readers do not notice:

* ``model(x)`` after fit: torch failed deep inside a matmul with a storage-size error. The forward guard
  (:func:`guard_released_modules`, installed at teardown) names the fix instead.
* ``model.state_dict()`` (``torch.save(model.state_dict(), ...)`` after fit, a callback saving weights at an epoch's
  end, peft's ``get_peft_model_state_dict``, HF's ``save_pretrained``): the state dict held zero-byte tensors, and
  ``torch.save`` wrote them without complaint. The file failed only when loaded, with torch's "Trying to resize
  storage that is not resizable" (2026-11-29): the trained weights were silently not saved. ``load_state_dict``
  into released parameters wrote into zero-byte storage. :func:`guard_state_dicts` refuses both, for every
  module with a parameter released at the moment of the call (the storage decides, not the bookkeeping: one rank's
  parameters alias its partition and read fine).

The strategy's own readers of the state dict (checkpoints, ``full_state_dict``) call it with ``keep_vars=True``
for names and identities and take values from the masters, so the guard lets ``keep_vars=True`` through.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.parallel.dtensor import local_tensor


class _Units(Protocol):
    """What the forward guard reads of a stage-3 engine (stage3.py's ``Stage3Engine``)."""

    units: list[Any]

    def is_gathered(self, unit: Any) -> bool: ...


_STATE_FIX = (
    "Use `trainer.strategy.full_state_dict()` (or `fabric.strategy.full_state_dict()`): the full fp32 weights, on every "
    "rank (collective, call it on all ranks), or save a checkpoint; inside "
    "`with trainer.strategy.gathered_params():` (every rank) the module's own state_dict() works too. For HF or "
    "peft `save_pretrained`, pass `state_dict=trainer.strategy.full_state_dict()`."
)


def _is_released(p: nn.Parameter) -> bool:
    t = local_tensor(p)
    return bool(t.numel()) and not t.is_meta and t.untyped_storage().nbytes() == 0


def _released(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if _is_released(p)]


def guard_state_dicts(model: nn.Module) -> list[RemovableHandle]:
    """``state_dict()`` and ``load_state_dict()`` of a module whose parameters are released raise, naming the
    parameter and the fix ([Note: released modules refuse, they do not return empty tensors])."""

    def on_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        names = [] if keep_vars else _released(module)
        if names:
            raise RuntimeError(
                f"'{prefix}{names[0]}' is partitioned by ZeRO stage 3: this rank holds only its shard, so "
                f"state_dict() here would hold empty tensors (a file saved from it loads nothing). {_STATE_FIX}"
            )

    def on_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        names = [n for n in _released(module) if prefix + n in state_dict]  # the strategy loads the rest this way
        if names:
            raise RuntimeError(
                f"'{prefix}{names[0]}' is partitioned by ZeRO stage 3 and released here, so load_state_dict() has "
                "nowhere to write it. Load the weights into the model before fit (or with `ckpt_path=`), or inside "
                "`with trainer.strategy.gathered_params(writeback=True):` on every rank."
            )

    handles: list[RemovableHandle] = []
    for m in model.modules():
        if next(m.parameters(recurse=False), None) is not None:
            handles.append(m.register_state_dict_pre_hook(on_save))
            handles.append(m.register_load_state_dict_pre_hook(on_load))
    return handles


def guard_released_modules(model: nn.Module, engine: _Units) -> list[RemovableHandle]:
    """After training, calling a module whose parameters are released raises a clear error
    (instead of a cryptic storage-size error deep inside a matmul)."""
    unit_of = {id(p): u for u in engine.units for p in u.params}  # by the bookkeeping, not the storage:
    # a one-rank group's parameters keep theirs (sharded_group.py [Note: one rank aliases its partition])

    def guard(module: nn.Module, args: Any) -> None:
        if any(id(p) in unit_of and not engine.is_gathered(unit_of[id(p)]) for p in module.parameters(recurse=False)):
            raise RuntimeError(
                f"{type(module).__name__}'s parameters are partitioned by ZeRO stage 3 and not gathered here. "
                "Call the model inside the Trainer, or wrap the call in "
                "`with trainer.strategy.gathered_params():` (all ranks), or load the full weights from a "
                "checkpoint (Lightning checkpoints hold a plain state dict)."
            )

    guard.lightning_zero_released_guard = True  # type: ignore[attr-defined]  # found by guarded_by_a_strategy
    return [
        m.register_forward_pre_hook(guard)
        for m in model.modules()
        if any(id(p) in unit_of for p in m.parameters(recurse=False))
    ]


def guarded_by_a_strategy(model: nn.Module) -> Optional[str]:
    """The name of the first submodule a stage-3 engine's forward guard is on (its strategy still partitions it;
    on one rank the parameters alias the partition, so their storage does not tell), None when none is."""
    for name, m in model.named_modules():
        if any(getattr(h, "lightning_zero_released_guard", False) for h in m._forward_pre_hooks.values()):
            return name or type(m).__name__
    return None


def refuse_released_elsewhere(model: nn.Module) -> None:
    """A module another strategy's ZeRO-3 still partitions (an earlier Trainer's ``fit`` or ``predict``: stage 3 does
    not hand the module back) has no values here to set up from: one clear error before any work, for a fit and an
    evaluation alike. Released parameters have zero-byte storage; on one rank they alias the partition, so the
    other strategy's forward guard tells (where the first forward used to fail naming a gather)."""
    released = [n for n, p in model.named_parameters() if _is_released(p)]
    guarded = guarded_by_a_strategy(model)
    if released or guarded is not None:
        what = f"'{released[0]}' and {len(released) - 1} more" if released else f"those of '{guarded}'"
        raise RuntimeError(
            f"The module's parameters ({what}) are partitioned by another strategy's ZeRO stage 3 (an earlier "
            "Trainer's fit or predict), which holds their values. Go on with that Trainer (`trainer.fit` or "
            "`trainer.predict` again), or build the module anew and give it the weights: "
            "`model.load_state_dict(old_trainer.strategy.full_state_dict())`, or a checkpoint of that run "
            "(`ckpt_path=...`, `MyModule.load_from_checkpoint(...)`)."
        )
