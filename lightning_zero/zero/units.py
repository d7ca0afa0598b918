"""Stage-3 units: the module subtrees whose parameters are gathered and released together.

[Note: what a unit is]
A unit is a module subtree chosen by a policy (default: every child of an ``nn.ModuleList`` or
``nn.ModuleDict``: the transformer blocks, or the layers of a PipelineModule). Every trainable parameter belongs to exactly one unit. Parameters outside any
matched subtree, and parameters shared by modules of different units (a tied embedding/head), go to
the *root unit*, which is gathered for a whole training step: that is what makes uses outside the
owning module's forward (``F.linear(h, self.emb.weight)``) correct without registration.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch import nn
from torch.nn import Parameter

ROOT = 0


@dataclass
class Unit:
    """One gather/release unit (index 0 is the root unit)."""

    index: int
    name: str
    module: Optional[nn.Module]
    """The subtree's root module (None for the root unit, which has no single module)."""
    params: list[Parameter] = field(default_factory=list)
    buckets: list[tuple[int, int]] = field(default_factory=list)
    """(param group index, bucket index) of this unit's flat segments."""
    numel: int = 0
    persistent: bool = False

    @property
    def is_root(self) -> bool:
        return self.index == ROOT


def _matches(name: str, module: nn.Module, policy: Sequence[str]) -> bool:
    cls = type(module).__name__
    return any(p == cls or fnmatch.fnmatchcase(name, p) for p in policy)


def find_units(model: nn.Module, policy: Optional[Sequence[str]]) -> list[Unit]:
    """Unit 0 is the root; the others are the outermost subtrees matched by ``policy``, in module order."""
    chosen: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if policy is None:
            parent_name = name.rpartition(".")[0]
            parent = model.get_submodule(parent_name) if parent_name else model
            hit = isinstance(parent, (nn.ModuleList, nn.ModuleDict))
        else:
            hit = _matches(name, module, policy)
        if hit:
            chosen.append((name, module))
            taken.append(name)
    if policy is not None and not chosen:
        classes = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise ValueError(
            f"unit_policy {list(policy)} matches no module of {type(model).__name__}. "
            f"Module classes present: {classes}."
        )
    units = [Unit(ROOT, "<root>", None)] + [Unit(i + 1, n, m) for i, (n, m) in enumerate(chosen)]
    return units


def assign_params(model: nn.Module, units: list[Unit], trainable: Sequence[Parameter]) -> dict[int, int]:
    """id(param) -> unit index; a parameter reachable from two units (tied) goes to the root."""
    wanted = {id(p) for p in trainable}
    owner: dict[int, int] = {}
    for unit in units[1:]:
        assert unit.module is not None
        for p in unit.module.parameters():
            if id(p) not in wanted:
                continue
            owner[id(p)] = ROOT if id(p) in owner and owner[id(p)] != unit.index else unit.index
    # a parameter also owned directly by a module outside every unit is shared with the root
    unit_modules = {id(m) for u in units[1:] for m in u.module.modules()}  # type: ignore[union-attr]
    for module in model.modules():
        if id(module) in unit_modules:
            continue
        for p in module.parameters(recurse=False):
            if id(p) in wanted and id(p) in owner:
                owner[id(p)] = ROOT
    for p in trainable:
        owner.setdefault(id(p), ROOT)
    return owner
