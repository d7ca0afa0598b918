"""The module a fit hands back: fp32 master values in the dtypes the user built, on the CPU, as after ``ddp``.

[Note: the module after fit]
Under the cast layout (precision.py [Note: two mixed-precision layouts]) the module trains in 16 bits and the
fp32 masters live in the engines' partitions. Left like that after ``trainer.fit(model)``, the user's module
held 16-bit weights where Lightning's ``ddp`` hands back its fp32 weights: ``torch.save(model.state_dict())``
wrote rounded weights, a second ``fit`` (a new Trainer, or the same one with more steps) started its masters
from the rounded values and so trained apart from ddp's continuation, and an fp32 input failed in a 16-bit
BatchNorm. So a fit that ended cleanly under stages 0-2 writes the masters back: every parameter becomes the
full fp32 master (``full_state_dict()``, gathered on every rank, collective) and every floating buffer returns
to its own dtype (its values are what the 16-bit run kept), on the CPU as Lightning's teardown leaves a ddp
module (unless the copies would take over half the host's free memory: then a warning, and the 16-bit module
stays; the decision is one for all ranks). The engines stay, so ``trainer.save_checkpoint()`` after fit still saves their shards; a later
``validate``/``test``/``fit`` sets the module up again.

Not under stage 3 (its parameters are released; ``state_dict()`` there is refused naming ``full_state_dict()``,
zero/released_guard.py) nor with tensor, pipeline or expert parallelism (a rank holds part of the module);
nothing to do under ``32-true`` or ``mixed_precision="autocast"`` (the module is fp32 and equal to the masters).
"""

from __future__ import annotations

from typing import Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module

from lightning_zero.comm import collectives as C
from lightning_zero.engines import Engines
from lightning_zero.offload.pinned import available_host_bytes

HOST_SHARE = 0.5
"""The fp32 copies of all ranks on a node may take at most this share of the host's free memory."""


def needs_restore(engines: Engines, module: Module) -> bool:
    """Whether the module holds parameters in another dtype than the user built them (the cast layout), under
    a layout where every rank holds all of it."""
    dims = engines.dims
    if engines.failed or not len(engines) or engines.config.stage >= 3:
        return False
    if dims is not None and (dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        return False
    return any(engines.orig_dtypes.get(name, p.dtype) != p.dtype for name, p in module.named_parameters())


def fits_on_host(engines: Engines, module: Module, ranks_per_node: int) -> tuple[bool, int, int]:
    """(whether every rank has room for its fp32 copy, bytes per node it takes, bytes available here); one answer
    for all ranks (collective), so that none starts the gather another skips."""
    need = ranks_per_node * sum(p.numel() * torch.empty((), dtype=engines.orig_dtypes.get(name, p.dtype)).element_size()
                                for name, p in module.named_parameters())
    free = available_host_bytes()
    return all(C.all_gather_object(need <= HOST_SHARE * free, None)), need, free


def restore_module(engines: Engines, module: Module, full_state_dict: Callable[[], dict[str, torch.Tensor]],
                   ranks_per_node: int) -> bool:
    """Parameters <- fp32 masters, buffers <- their own dtypes, all on the CPU (collective: every rank calls it).
    False, with one warning, where the copies would take more than :data:`HOST_SHARE` of the host's free memory
    (a model trained under ZeRO need not fit on the host once per rank): the module then keeps its 16-bit weights."""
    fits, need, free = fits_on_host(engines, module, ranks_per_node)
    if not fits:
        rank_zero_warn(f"lightning_zero: after fit the module keeps its 16-bit training weights: fp32 copies on every "
                       f"rank would take {need / 2**30:.1f} GiB of host memory ({ranks_per_node} ranks per node), "
                       f"{free / 2**30:.1f} GiB are free. trainer.strategy.full_state_dict() gives the fp32 masters.")
        return False
    full = full_state_dict()  # the masters in the user's dtypes, on the CPU, every rank
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.data = full[name]
            p.grad = None
        for name, b in module.named_buffers():
            want = engines.orig_buffer_dtypes.get(name, b.dtype)
            b.data = full[name] if name in full else b.data.to("cpu", want)
    module.cpu()  # anything left (a buffer of no state dict, not floating)
    return True
