"""inplace_guard.py [Note: in-place writes outside the optimizer]: the version-counter checks on their own
(the gathered case end to end: tests/unit/test_zero3_single.py; ``p.data`` after a step: tests/zoo and
tests/fabric). A write into a released parameter usually crashes the process at the write itself (its
storage has no bytes), so the released case is checked here, on a parameter with real storage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_zero.zero.inplace_guard import InPlaceGuard


def _unit() -> tuple[SimpleNamespace, nn.Parameter, InPlaceGuard]:
    p = nn.Parameter(torch.ones(4))
    return SimpleNamespace(index=3, params=[p]), p, InPlaceGuard({id(p): "blocks.0.w"})


def test_untouched_units_pass_every_check() -> None:
    unit, p, guard = _unit()
    guard.before_gather(unit)  # never released: nothing recorded
    guard.gathered(unit)
    guard.before_release(unit)
    guard.released(unit)
    guard.before_gather(unit)


def test_a_write_while_gathered_is_refused_at_the_release() -> None:
    unit, p, guard = _unit()
    guard.gathered(unit)
    with torch.no_grad():
        p.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"'blocks.0.w' was modified in place outside the optimizer while gathered"):
        guard.before_release(unit)


def test_a_write_while_released_is_refused_at_the_next_gather() -> None:
    unit, p, guard = _unit()
    guard.released(unit)
    with torch.no_grad():
        nn.init.zeros_(p)  # a re-initialisation mid-training
    with pytest.raises(RuntimeError, match=r"'blocks.0.w' .* while its unit was released.*gathered_params"):
        guard.before_gather(unit)


def test_a_write_back_through_gathered_params_is_re_recorded() -> None:
    """``gathered_params(writeback=True)`` writes the change into the partitions, then records again."""
    unit, p, guard = _unit()
    guard.gathered(unit)
    with torch.no_grad():
        p.clamp_(0.0, 0.5)
    guard.gathered(unit)
    guard.before_release(unit)


def test_clear_forgets_every_record() -> None:
    unit, p, guard = _unit()
    guard.released(unit)
    with torch.no_grad():
        p.add_(1.0)
    guard.clear()
    guard.before_gather(unit)


def test_new_storage_while_gathered_is_refused_at_the_release() -> None:
    """``w.data = F.normalize(w.data)`` left the parameter on the user's tensor for good while the optimizer
    stepped the partitions: 0.17 apart from ddp in 6 steps, silently (rebind.py [Note: replaced parameter
    storage])."""
    unit, p, guard = _unit()
    guard.gathered(unit)
    p.data = p.data * 2.0
    with pytest.raises(RuntimeError, match=r"'blocks.0.w' was given new storage \(`p.data = ...`\).*gathered_params"):
        guard.before_release(unit)


def test_new_storage_while_released_is_refused_at_the_next_gather() -> None:
    unit, p, guard = _unit()
    guard.released(unit)
    p.data = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"'blocks.0.w' was given new storage .* while its unit was released"):
        guard.before_gather(unit)


def test_a_write_through_a_data_alias_is_refused_at_the_release() -> None:
    """``w.data.copy_(...)`` in a unit's forward: the alias has a version counter of its own, so the read watch
    hands it over (read_watch.py); a read through one (``w.data.norm()``) passes."""
    unit, p, guard = _unit()
    guard.gathered(unit)
    read, written = p.data, p.data
    guard.alias(unit, p, read)
    guard.alias(unit, p, written)
    read.norm()
    written.copy_(torch.full((4,), 0.5))
    with pytest.raises(RuntimeError, match=r"'blocks.0.w' was modified in place through `.data`.*gathered_params"):
        guard.before_release(unit)
    unit2, p2, guard2 = _unit()
    guard2.gathered(unit2)
    alias = p2.data
    guard2.alias(unit2, p2, alias)
    guard2.gathered(unit2)  # gathered_params(writeback=True) took the change: recorded again
    alias.add_(1.0)
    guard2.before_release(unit2)
