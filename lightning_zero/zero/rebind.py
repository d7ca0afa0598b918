"""Parameters whose ``.data`` user code replaced: put back into their flat buffer, their new values kept.

[Note: replaced parameter storage]
Stages 0-2 make every trainable parameter a view into its group's ``flat_param`` (flat_group.py [Note:
parameters are views]), and the write-back after each step reaches the model through those views. Code that
*assigns* ``p.data = new`` rather than writing in place (``w.data = F.normalize(w.data, dim=1)`` in a cosine
classifier's forward or ``on_train_batch_start``, ``p.data = p.data.clamp(-c, c)`` after the step) gives the
parameter storage of its own: the merge of flat_group.py [Note: writes outside the optimizer] compared
``flat_param`` with the masters and found nothing, the step updated the masters and ``flat_param``, and the
parameter kept the user's tensor for ever. Measured (2 gloo ranks, fp32, AdamW, a head normalised that way):
stages 1 and 2 trained apart from ``ddp`` from the first step, weights 0.17 apart after 6 steps, silently. ddp
keeps the new tensor and steps it. So before every step (:meth:`Engines.step`; offload's step during
backward: before its first bucket) and before a state dict is read (state_dict.py) a parameter whose storage is no longer its view gets its values copied into
the view and is pointed back at it; the ordinary merge then takes the change as it takes an in-place write.
Cost: one pointer comparison per parameter per step. Another shape cannot be followed (the flat layout is fixed
at setup) and is refused, naming the parameter. Stage 3 keeps no full copy between gathers: a replaced gathered
parameter is refused at its unit's release (inplace_guard.py [Note: in-place writes outside the optimizer]).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.parallel.dtensor import local_tensor, point_local


def is_replaced(param: Parameter, view_ptr: int) -> bool:
    """Whether ``param`` (its local TP shard) no longer is the contiguous view starting at ``view_ptr``."""
    local = local_tensor(param)
    return local.data_ptr() != view_ptr or not local.is_contiguous()


def rebind(param: Parameter, flat_slice: Tensor, shape: torch.Size, name: str) -> None:
    """Copy ``param``'s current values into ``flat_slice`` (its 1-D piece of the flat buffer) and make the
    parameter a view of it again, as it was at setup with ``shape``."""
    local = local_tensor(param)
    if local.shape != shape:
        raise ValueError(
            f"Parameter '{name}' was given storage of shape {tuple(local.shape)} (`p.data = ...`) where it was built "
            f"with {tuple(shape)}: ZeRO's flat buffers are laid out at setup, so a parameter keeps its shape. Assign "
            "values of the same shape, or write in place (`p.data.copy_(...)`)."
        )
    values = local.detach().clone()  # it may overlap the view (a transposed alias of it)
    view = flat_slice.view(shape)
    view.copy_(values)
    point_local(param, view)


def rebind_groups(groups: Sequence[Any], names: dict[int, str]) -> None:
    """Before a step: every group's parameters given new storage since the last step go back into its flat
    buffer, values kept (stage 3's groups do nothing: see the Note)."""
    for fg in groups:
        fg.rebind_params(names)


__all__ = ["is_replaced", "rebind", "rebind_groups"]
