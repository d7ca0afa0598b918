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

``p.data.clamp_()`` writes through a tensor with a counter of its own, so only that watch sees it.
``gathered_params(module, writeback=True)`` is the supported route: it re-records the counters after writing
the changes into the partitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_zero.zero.units import Unit

FIX = "Modify parameters inside `with strategy.gathered_params(module, writeback=True):` instead."


class InPlaceGuard:
    """The version counters of each unit's parameters, recorded when it was gathered and when released."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        """id(param) -> its name, for the error."""
        self._gathered: dict[int, list[int]] = {}
        self._released: dict[int, list[int]] = {}

    def gathered(self, unit: "Unit") -> None:
        """The unit's gather completed (or user code wrote it back): its values are the partitions' from here."""
        self._gathered[unit.index] = [p._version for p in unit.params]

    def before_release(self, unit: "Unit") -> None:
        self._check(unit, self._gathered.pop(unit.index, None),
                    "while gathered; the change would be lost when its unit is released")

    def released(self, unit: "Unit") -> None:
        self._released[unit.index] = [p._version for p in unit.params]

    def before_gather(self, unit: "Unit") -> None:
        self._check(unit, self._released.pop(unit.index, None),
                    "while its unit was released (it holds no values between its uses); the change was lost")

    def clear(self) -> None:
        """Parameters own plain storage again (``unshard_to_plain``): nothing to guard."""
        self._gathered.clear()
        self._released.clear()

    def _check(self, unit: "Unit", before: "list[int] | None", when: str) -> None:
        if before is None:
            return
        for p, v in zip(unit.params, before):
            if p._version != v:
                name = self.names.get(id(p), "a parameter")
                raise RuntimeError(f"ZeRO-3: '{name}' was modified in place outside the optimizer {when}. {FIX}")


__all__ = ["InPlaceGuard"]
