"""Which modules the strategy's ``activation_offload`` option checkpoints, and applying it.

[Note: the strategy option]
``ZeroStrategy(activation_offload=True)`` checkpoints every stage-3 unit (the engine's units: the
modules whose parameters are gathered together; units.py [Note: what a unit is]), with its
checkpoint in pinned host memory (offload.py). Below stage 3 and under pipeline stages, where no
engine has units, the same default policy (repeated blocks) chooses the modules, so the option
means the same everywhere. ``activation_offload_policy`` (class names or fnmatch patterns of module
names, like ``unit_policy``) chooses other modules. The modules are wrapped in place (their
``forward``; offload.py's :func:`~lightning_zero.activations.offload.checkpoint`), so ZeRO-3's unit
hooks run outside the checkpointed region, gather before the forward and, in backward, before the
recomputation (the unit's backward pre-hook fires on its outputs' gradients, before any saved tensor
of the region is unpacked). All wrapped modules share one offloader, so each recomputation prefetches
the next one's checkpoint. A model that checkpoints these modules itself (``GPTConfig
.activation_checkpointing``) would recompute twice: turn one of the two off.

[Note: the device share]
``activation_offload_device_fraction`` f keeps the checkpoints of the last ``round(f * n)`` of the n
modules (forward order) in device memory: they are checkpointed the same way (recomputed in backward,
bit for bit), only not copied out. The last ones, because backward reaches them first: their memory is
free before backward's own peak, and the host copies backward waits for start one module later (the
first offloaded module's copy back is not prefetched: nothing recomputed before it asks for it). The
split is taken over all the chosen modules, so setup running again keeps it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from lightning_zero.activations.offload import HostOffloader, checkpoint, is_checkpointed
from lightning_zero.zero.units import find_units


def offload_targets(model: nn.Module, policy: Optional[Sequence[str]], units: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The modules to checkpoint: ``units`` (stage 3's) when no policy is given and there are any,
    else what units.py's ``find_units`` picks under ``policy`` (None: repeated blocks)."""
    if policy is None and units:
        return list(units)
    return [u.module for u in find_units(model, policy)[1:] if u.module is not None]


def apply_activation_offload(
    model: nn.Module,
    policy: Optional[Sequence[str]] = None,
    units: Sequence[nn.Module] = (),
    offloader: Optional[HostOffloader] = None,
    device_fraction: float = 0.0,
) -> list[nn.Module]:
    """Checkpoint (with host offload) the modules :func:`offload_targets` chooses, the last
    ``device_fraction`` of them without the offload ([Note: the device share]); idempotent (a module
    already wrapped is left alone, so setup running again for validate/test changes nothing).
    Returns the modules wrapped now."""
    chosen = offload_targets(model, policy, units)
    on_device = set(map(id, chosen[len(chosen) - round(device_fraction * len(chosen)):])) if chosen else set()
    targets = [m for m in chosen if not is_checkpointed(m)]
    if not targets:
        return []
    shared = offloader or HostOffloader()
    for module in targets:
        checkpoint(module, offload="none" if id(module) in on_device else "cpu", offloader=shared)
    return targets


__all__ = ["apply_activation_offload", "offload_targets"]
