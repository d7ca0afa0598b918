"""What the ZeRO engines need to know about DTensor parameters (tensor parallelism): their local shard.

[Note: ZeRO sees the local TP shard]
After ``parallelize_module`` a tensor-parallel layer's parameters are ``DTensor``s: a global shape, a
placement on the ``tp`` mesh dim, and each rank's piece in ``_local_tensor``. The engines flatten,
partition and reduce only that piece, over the data-parallel group: the ranks of one dp group hold
the same TP shard (the same ``tp_rank``), so its gradient is summed over dp exactly as a plain
parameter's. The piece's storage becomes a view into the flat buffer by ``local.data = view`` (the
DTensor keeps its identity, shape and placements; every op unwraps ``_local_tensor`` afresh), and a
gradient handed back to the user is a DTensor wrapping a view of the flat gradient buffer, so autograd
accumulates into that buffer in place. Parameters that are not DTensors (embeddings, norms outside the
plan) and DTensors replicated over tp get identical gradients on every tp rank after TP's own
collectives; only the gradient norm must tell the two kinds apart (:func:`is_tp_sharded`).

[Note: a DTensor's dtype is its own]
A DTensor carries its dtype in the wrapper, apart from its local piece: re-pointing the local piece at a
16-bit buffer (mixed precision) would leave an fp32 DTensor around bf16 storage, and autograd then
refuses the 16-bit gradient. So where the dtype changes, :func:`point_local` swaps in a new DTensor
parameter wrapping the view (``torch.utils.swap_tensors``, as ``nn.Module._apply`` does for tensor
subclasses): the parameter object keeps its identity (optimizer, module and engine references) and
takes the view's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_tensor(t: Tensor) -> Tensor:
    """The rank's own storage of ``t``: the local shard of a DTensor, ``t`` itself otherwise. Setting
    ``.data`` of what this returns re-points the DTensor's local piece (see the note)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def point_local(param: Tensor, view: Tensor) -> None:
    """Make ``view`` the storage of ``param`` (of its local TP shard for a DTensor; ``view`` has the
    local shape), in ``view``'s dtype ([Note: a DTensor's dtype is its own])."""
    if not isinstance(param, DTensor):
        param.data = view
    elif view.dtype == param.dtype:
        param._local_tensor.data = view
    else:
        new = DTensor.from_local(view, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                 stride=param.stride())
        torch.utils.swap_tensors(param, Parameter(new, requires_grad=param.requires_grad))


def is_tp_sharded(t: Tensor) -> bool:
    """Whether each tensor-parallel rank holds a different piece of ``t`` (a DTensor with a Shard
    placement); replicated tensors hold the same values on every tp rank."""
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def local_grad(param: Tensor, grad: Tensor) -> Tensor:
    """``grad``'s piece matching ``param``'s local shard (a gradient DTensor whose placements differ from
    its parameter's is redistributed first: a collective over the parameter's mesh)."""
    if not isinstance(grad, DTensor):
        return grad
    if isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def grad_like(param: Tensor, local: Tensor) -> Tensor:
    """A gradient for ``param`` that is ``local`` (a view into a flat buffer): ``local`` itself for a
    plain parameter, a DTensor wrapping it for a DTensor parameter (no copy)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def local_block(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset in the global tensor) of this rank's piece of ``t``, from torch's placement
    arithmetic for a DTensor (as DCP's chunk metadata uses it); the whole tensor otherwise. Checkpoints
    place a TP shard's pieces with it (checkpoint/pieces.py [Note: tensor-parallel pieces])."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.dim()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)
