"""Stage-3 units: the module subtrees whose parameters are gathered and released together.

[Note: what a unit is]
A unit is a module subtree chosen by a policy. The default picks *repeated blocks*: walking down
from the model through plain containers (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``, by
exact type: a subclass such as torchvision's ``Conv2dNormActivation`` is a block, not a container),
a child of a container becomes a unit when it holds parameters and its class occurs at least twice
among such children anywhere in the model: transformer blocks in ``transformer.h`` (nanoGPT,
GPT-2), ``model.layers`` (Llama), timm's ``blocks = nn.Sequential(...)``, the BasicBlocks of
torchvision's ``layer1``...``layer4``. A container is never a unit itself (nanoGPT never calls
``transformer.h``; iterating a Sequential does not call its forward), and one-of-a-kind modules (an
embedding in a ModuleDict, whose weight is often read by a tied head outside its forward) stay with
the root. Every parameter belongs to exactly one unit. Parameters outside any unit, and parameters
shared by modules of different units (a tied embedding/head), go to the *root unit*, which is
gathered for a whole step. A parameter of a unit read outside that unit's forward is found at run
time (read_watch.py's [Note: reads outside a unit]).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch import nn
from torch.nn import Parameter

ROOT = 0

CONTAINERS: tuple[type, ...] = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
"""Exact types the default policy walks through (never units themselves)."""


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
    """Small enough to stay gathered for the whole run (``param_persistence_threshold``)."""
    resident: bool = False
    """Read outside its own forward: gathered with the root unit for the whole step."""

    @property
    def is_root(self) -> bool:
        return self.index == ROOT

    @property
    def held_for_step(self) -> bool:
        """Gathered at the start of a step and released only at its end (root and resident units)."""
        return self.is_root or self.resident


def _matches(name: str, module: nn.Module, policy: Sequence[str]) -> bool:
    cls = type(module).__name__
    return any(p == cls or fnmatch.fnmatchcase(name, p) for p in policy)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default policy (see [Note: what a unit is]): modules with parameters that sit in a plain
    container, whose class occurs at least twice among all such modules of the model; outermost
    first, in module order."""
    candidates: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str, in_container: bool) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if type(child) in CONTAINERS:
                walk(child, full, True)
                continue
            if in_container and id(child) not in seen and _has_params(child):
                seen.add(id(child))
                candidates.append((full, child))
            walk(child, full, False)

    walk(model, "", type(model) in CONTAINERS)
    counts = Counter(type(m) for _, m in candidates)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in candidates:
        if counts[type(module)] >= 2 and not any(name.startswith(t + ".") for t, _ in chosen):
            chosen.append((name, module))
    return chosen


def find_units(model: nn.Module, policy: Optional[Sequence[str]]) -> list[Unit]:
    """Unit 0 is the root; the others are the outermost subtrees chosen by ``policy`` (None: repeated
    blocks), in module order."""
    if policy is None:
        chosen = _repeated_blocks(model)
    else:
        chosen = []
        taken: list[str] = []
        for name, module in model.named_modules():
            if not name or any(name == t or name.startswith(t + ".") for t in taken):
                continue
            if _matches(name, module, policy):
                chosen.append((name, module))
                taken.append(name)
        if not chosen:
            classes = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise ValueError(
                f"unit_policy {list(policy)} matches no module of {type(model).__name__}. "
                f"Module classes present: {classes}."
            )
    return [Unit(ROOT, "<root>", None)] + [Unit(i + 1, n, m) for i, (n, m) in enumerate(chosen)]


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
