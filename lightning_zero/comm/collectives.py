"""Every torch.distributed call of lightning_zero goes through this module.

Why one module: a reader finds every point where ranks must agree in one file, tests can count
or fake traffic by wrapping these functions, and a later compressed or offloaded backend changes
one place. Each function takes its process group explicitly (no module globals), and tolerates
``group is None`` with an uninitialised default group as the world of one process, so the same
engine code runs in a single process without special cases.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ProcessGroup = dist.ProcessGroup

# [Note: current collective names]
# torch renamed its single-tensor collectives: ``reduce_scatter_single`` / ``all_gather_single`` are the
# current names, and ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` print a FutureWarning on
# every call (torch 2.13) before forwarding to them. Older torch (>= 2.4, which we support) has only the
# old names. The name is picked once by feature detection, never from version strings (a backport or a
# nightly with the new name uses it), and looked up on ``torch.distributed`` at each call, so tests that
# wrap torch's functions (tests/onebit/bytecount.py) see the calls. Same semantics either way: one flat
# output, the ranks' chunks concatenated along dim 0.
def _current_name(new: str, old: str) -> str:
    """``new`` where this torch has it, else ``old`` (see [Note: current collective names])."""
    return new if callable(getattr(dist, new, None)) else old


REDUCE_SCATTER_FN = _current_name("reduce_scatter_single", "reduce_scatter_tensor")
"""Name of the ``torch.distributed`` function :func:`reduce_scatter` calls."""
ALL_GATHER_FN = _current_name("all_gather_single", "all_gather_into_tensor")
"""Name of the ``torch.distributed`` function :func:`all_gather` calls."""


class _DoneWork:
    """A finished work handle for the single-process case, so callers can always ``wait()``."""

    def wait(self) -> bool:
        return True


def done() -> _DoneWork:
    """A work handle that is already finished (a collective skipped because one rank has nothing to exchange)."""
    return _DoneWork()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Optional[ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group: Optional[ProcessGroup] = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def global_rank_of(group: Optional[ProcessGroup], group_rank: int) -> int:
    """The global rank of ``group_rank`` inside ``group`` (needed by broadcast/send)."""
    if not is_initialized() or group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def init_process_group(backend: str, world: int, global_rank: int, timeout_s: float) -> None:
    """Create the default group (env:// rendezvous, set up by Lightning's cluster environment)."""
    if is_initialized():
        return
    dist.init_process_group(backend, world_size=world, rank=global_rank, timeout=timedelta(seconds=timeout_s))


# [Note: destroy at exit]
# A job that ends without ``destroy_process_group()`` (Lightning destroys only NCCL groups at exit)
# leaves its gloo groups to interpreter finalisation: a gloo worker thread still holding a work
# object whose tensors reference Python objects then takes the GIL in a dying interpreter, and the
# process aborts ("terminate called without an active exception") after training finished, while
# or after rank 0 writes its results. Seen intermittently at the exit of multi-fit gloo workers;
# the same diagnosis is in pytorch/pytorch PR 179291. After a fit that ended cleanly the strategy
# asks for every group to be destroyed at exit, while the interpreter is whole. Not after a
# failure: a peer may be gone, and destroying a group with a collective in flight could wait for
# its timeout instead of letting the process end.
# The handler is registered when the strategy sets its groups up, not at teardown: Fabric calls no
# teardown, and its workers aborted at exit the same way (seen once in CI, 2026-11-23). A failure the
# strategy sees unregisters it; an uncaught exception that ends the interpreter (a Fabric loop that
# raised: no hook tells the strategy) leaves ``sys.last_value`` set before atexit runs, and the
# handler then does nothing.
def destroy_groups_at_exit(enabled: bool) -> None:
    """Destroy every process group at interpreter exit (``enabled``), or no longer (see
    [Note: destroy at exit]). Idempotent: the handler is registered at most once."""
    atexit.unregister(_destroy_all_groups)
    if enabled:
        atexit.register(_destroy_all_groups)


def _destroy_all_groups() -> None:
    if is_initialized() and getattr(sys, "last_value", None) is None:  # not while an uncaught error ends the run
        dist.destroy_process_group()


def new_group(ranks: Sequence[int], timeout_s: Optional[float] = None) -> Optional[ProcessGroup]:
    """A sub-group. Every rank must call this for every group, in the same order."""
    if not is_initialized():
        return None
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    return dist.new_group(list(ranks), **kwargs)


def init_device_mesh(device_type: str, shape: Sequence[int], names: Sequence[str],
                     timeout_s: Optional[float] = None) -> Optional["DeviceMesh"]:
    """torch's DeviceMesh over every rank (collective: every rank calls it, in the same order), its
    dims named ``names``; ranks laid out row-major over ``shape`` (the last dim innermost). None in a
    process without a default group (the world of one process: nothing to split). ``timeout_s``:
    the groups the mesh creates get it (``init_device_mesh`` has no timeout argument: it goes in
    through the backend options; a dim spanning the world reuses the default group and its timeout)."""
    if not is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh as _init_device_mesh

    override = None
    if timeout_s:
        backend = str(dist.get_backend())
        options = _backend_options(backend, timeout_s)
        if options is not None:
            override = {name: (backend, options) for name in names}
    return _init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names), backend_override=override)


def _backend_options(backend: str, timeout_s: float) -> Optional[object]:
    """The process-group options of ``backend`` carrying ``timeout_s`` (None for other backends)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timedelta(seconds=timeout_s)
    return options


def new_gloo_group(timeout_s: Optional[float] = None) -> Optional[ProcessGroup]:
    """A gloo group over every rank (collective: every rank calls it). Checkpoint I/O runs its
    collectives here: on the CPU, and in a background thread (async save) without interleaving with
    the training's own collectives on the default group."""
    if not is_initialized():
        return None
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo", **kwargs)


def host_twin(group: Optional[ProcessGroup], timeout_s: Optional[float] = None) -> Optional[ProcessGroup]:
    """A gloo group over ``group``'s ranks (``group`` itself when it is gloo already; None in one process), for
    agreements the host needs without waiting for the device (zero/buffers.py [Note: buffer sync]). Collective
    over the world: every rank calls it at the same point, and creates every rank's twin in the same order."""
    if not is_initialized() or dist.get_world_size() == 1:
        return None
    if backend(group) == "gloo":
        return group
    mine = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    twin = None
    for ranks in sorted(set(all_gather_object(mine, None))):  # type: ignore[type-var]
        g = dist.new_group(list(ranks), backend="gloo", **kwargs)  # type: ignore[arg-type]
        if ranks == mine:
            twin = g
    return twin


def all_gather_object(obj: object, group: Optional[ProcessGroup]) -> list[object]:
    """Every rank's ``obj``, in group-rank order (pickled: small objects only)."""
    if _single(group):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _single(group: Optional[ProcessGroup]) -> bool:
    return not is_initialized() or dist.get_world_size(group) == 1


def all_reduce(tensor: Tensor, group: Optional[ProcessGroup], op: str = "sum", async_op: bool = False):
    """In-place all-reduce; ``op`` is 'sum', 'max' or 'min' (averages are pre-divided by callers)."""
    if _single(group):
        return _DoneWork() if async_op else None
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    return dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op)


def reduce_scatter(output: Tensor, input: Tensor, group: Optional[ProcessGroup], async_op: bool = False):
    """Sum ``input`` (N x len(output) elements) over ranks; rank r receives chunk r into ``output``."""
    if _single(group):
        output.copy_(input)
        return _DoneWork() if async_op else None
    return getattr(dist, REDUCE_SCATTER_FN)(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, group: Optional[ProcessGroup], async_op: bool = False):
    """Concatenate every rank's ``input`` into ``output`` (N x len(input) elements), in rank order."""
    if _single(group):
        output.copy_(input)
        return _DoneWork() if async_op else None
    return getattr(dist, ALL_GATHER_FN)(output, input, group=group, async_op=async_op)


def all_gather_list(tensors: list[Tensor], tensor: Tensor, group: Optional[ProcessGroup]) -> None:
    """All-gather into a list of equally shaped tensors (Lightning's ``all_gather`` semantics)."""
    if _single(group):
        tensors[0].copy_(tensor)
        return
    dist.all_gather(tensors, tensor, group=group)


def broadcast(tensor: Tensor, src_group_rank: int, group: Optional[ProcessGroup]) -> None:
    if _single(group):
        return
    dist.broadcast(tensor, src=global_rank_of(group, src_group_rank), group=group)


def broadcast_object(obj: object, src_group_rank: int, group: Optional[ProcessGroup]) -> object:
    if _single(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank_of(group, src_group_rank), group=group)
    return box[0]


def all_to_all(output: Tensor, input: Tensor, group: Optional[ProcessGroup], async_op: bool = False):
    """Equal-split all-to-all: chunk j of ``input`` goes to rank j, chunk i of ``output`` comes from rank i."""
    if _single(group):
        output.copy_(input)
        return _DoneWork() if async_op else None
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def all_to_all_single(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: Optional[ProcessGroup],
    async_op: bool = False,
):
    """Uneven all-to-all along dim 0: the first ``input_split_sizes[j]`` rows after the earlier splits go to
    rank j; ``output`` receives ``output_split_sizes[i]`` rows from rank i, in rank order. Both ranks of a
    pair must agree on the count they exchange (exchange the counts first, e.g. with :func:`all_to_all`).
    One process: ``output`` is a copy of ``input`` (the two split lists are then both ``[len(input)]``)."""
    if _single(group):
        output.copy_(input)
        return _DoneWork() if async_op else None
    return dist.all_to_all_single(
        output, input, output_split_sizes=list(output_split_sizes), input_split_sizes=list(input_split_sizes),
        group=group, async_op=async_op,
    )


def send(tensor: Tensor, dst_group_rank: int, group: Optional[ProcessGroup]) -> None:
    dist.send(tensor, dst=global_rank_of(group, dst_group_rank), group=group)


def recv(tensor: Tensor, src_group_rank: int, group: Optional[ProcessGroup]) -> None:
    dist.recv(tensor, src=global_rank_of(group, src_group_rank), group=group)


def send_recv(
    sends: Sequence[tuple[Tensor, int]],
    recvs: Sequence[tuple[Tensor, int]],
    group: Optional[ProcessGroup],
    wait: bool = True,
) -> list:
    """Post every ``(tensor, peer group rank)`` send and receive at once; wait for all unless ``wait``
    is False, then return the work handles: one per operation, sends first (gloo), or one for the
    whole batch (NCCL coalesces it into one group call).

    One ``batch_isend_irecv``: sends and receives between the same two ranks progress together
    instead of queueing behind each other on the pair's stream, which is how pipeline stages
    exchange activations and gradients without deadlock (pipeline/schedule.py).
    """
    ops = [dist.P2POp(dist.isend, t, global_rank_of(group, p), group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank_of(group, p), group) for t, p in recvs]
    if not ops:
        return []
    works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
    if wait:
        for work in works:
            work.wait()
    return works


def barrier(group: Optional[ProcessGroup] = None, device_ids: Optional[list[int]] = None) -> None:
    if _single(group):
        return
    if device_ids is not None and dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=device_ids)
    else:
        dist.barrier(group=group)


def backend(group: Optional[ProcessGroup] = None) -> Optional[str]:
    return dist.get_backend(group) if is_initialized() else None


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def sum_scalar(value: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Sum a 0-d/1-d tensor over ``group`` and return it (a new tensor on the same device)."""
    out = value.detach().clone()
    all_reduce(out, group, "sum")
    return out


def device_for(group: Optional[ProcessGroup], fallback: torch.device) -> torch.device:
    """Where collective tensors must live for ``group``: CUDA for NCCL, CPU for gloo."""
    if is_initialized() and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return fallback
