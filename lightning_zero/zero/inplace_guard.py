"""In-place writes into a stage-3 unit's parameters outside the optimizer, found by their version counters.

[Note: in-place writes outside the optimizer]
A stage-3 parameter holds its unit's values only while the unit is gathered; the partitions (masters and
their 16-bit copies) are the truth. An in-place op on the parameter itself (``p.mul_()``, an ``nn.init.*_``
re-initialisation, ``p.clamp_()`` under ``no_grad``) bumps its version counter, where ddp would simply keep
the new values. Two cases, both refused with an error naming the parameter, never trained through:

* *while gathered*: the write would be discarded at the release. Checked when the unit is released, against
  the counters recorded once its gather completed (the gather's own write into the buffer comes before).
* *while released*: the write lands in storage of no size (lost, or on a GPU an illegal access). Checked
  when the unit is next gathered, before the gather writes, against the counters recorded at the release.
  This catches a pattern that starts after the first step too, which the first step's watch cannot
  (read_watch.py [Note: reads after a step]).

``p.data.clamp_()`` writes through a tensor with a counter of its own. After a step only the read watch sees
it (read_watch.py [Note: reads after a step]); in a unit's forward (``w.data.copy_(F.normalize(w.data))``) that
watch hands each ``.data`` alias it sees during the first batch to :meth:`InPlaceGuard.alias`, and a write
through one is refused at the release too (measured before: the weight written so trained 0.17 apart from ddp
in 6 steps, silently). Replacing the storage (``p.data = new``) is refused the same way, found by the
parameter's data pointer: its values would stay the user's tensor for good while the optimizer stepped the
partitions (stages 0-2 follow it instead: rebind.py [Note: replaced parameter storage]).
``gathered_params(module, writeback=True)`` is the supported route: it re-records the counters after writing
the changes into the partitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_zero.parallel.dtensor import local_tensor

if TYPE_CHECKING:
    from torch import Tensor

    from lightning_zero.zero.units import Unit

FIX = "Modify parameters inside `with strategy.gathered_params(module, writeback=True):` instead."


def _state(p: "Tensor") -> tuple[int, int]:
    """What changes when a parameter is written in place (its version) or given new storage (its data pointer;
    stable across a release, which resizes the storage to zero)."""
    return p._version, local_tensor(p).data_ptr()


class InPlaceGuard:
    """The version counters and storage of each unit's parameters, recorded when it was gathered and released."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        """id(param) -> its name, for the error."""
        self._gathered: dict[int, list[tuple[int, int]]] = {}
        self._released: dict[int, list[tuple[int, int]]] = {}
        self._aliases: dict[int, list[tuple["Tensor", int, int]]] = {}
        """unit index -> (a ``.data`` alias of a gathered parameter, its version then, id(param)), see the Note."""

    def gathered(self, unit: "Unit") -> None:
        """The unit's gather completed (or user code wrote it back): its values are the partitions' from here."""
        self._gathered[unit.index] = [_state(p) for p in unit.params]
        self._aliases.pop(unit.index, None)

    def alias(self, unit: "Unit", param: "Tensor", alias: "Tensor") -> None:
        """``alias`` is ``param.data``, taken while ``unit`` is gathered: a write through it is refused at the
        release like one on the parameter (its version counter is its own)."""
        if unit.index in self._gathered:
            self._aliases.setdefault(unit.index, []).append((alias, alias._version, id(param)))

    def before_release(self, unit: "Unit") -> None:
        when = "while gathered; the change would be lost when its unit is released"
        for alias, version, pid in self._aliases.pop(unit.index, []):
            if alias._version != version:
                raise RuntimeError(f"ZeRO-3: '{self.names.get(pid, 'a parameter')}' was modified in place through "
                                   f"`.data` outside the optimizer {when}. {FIX}")
        self._check(unit, self._gathered.pop(unit.index, None), when)

    def released(self, unit: "Unit") -> None:
        self._released[unit.index] = [_state(p) for p in unit.params]

    def before_gather(self, unit: "Unit") -> None:
        self._check(unit, self._released.pop(unit.index, None),
                    "while its unit was released (it holds no values between its uses); the change was lost")

    def clear(self) -> None:
        """Parameters own plain storage again (``unshard_to_plain``): nothing to guard."""
        self._gathered.clear()
        self._released.clear()
        self._aliases.clear()

    def _check(self, unit: "Unit", before: "list[tuple[int, int]] | None", when: str) -> None:
        if before is None:
            return
        for p, (version, ptr) in zip(unit.params, before):
            now_version, now_ptr = _state(p)
            if now_ptr != ptr:
                name = self.names.get(id(p), "a parameter")
                raise RuntimeError(f"ZeRO-3: '{name}' was given new storage (`p.data = ...`) outside the optimizer "
                                   f"{when}. {FIX}")
            if now_version != version:
                name = self.names.get(id(p), "a parameter")
                raise RuntimeError(f"ZeRO-3: '{name}' was modified in place outside the optimizer {when}. {FIX}")


__all__ = ["InPlaceGuard"]
