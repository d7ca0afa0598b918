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
module (unless the copies would take over half the host's free memory, or the gather more than the GPU has
free: then a warning, and the 16-bit module stays; the decision is one for all ranks). The engines stay, so
``trainer.save_checkpoint()`` after fit still saves their shards; a later ``validate``/``test``/``fit`` sets the
module up again.

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
from lightning_zero.frozen_fp32 import HOST_SHARE  # the fp32 copies of a node's ranks: this share of free memory
from lightning_zero.offload.pinned import available_host_bytes



def needs_restore(engines: Engines, module: Module) -> bool:
    """Whether the module holds parameters in another dtype than the user built them (the cast layout), under
    a layout where every rank holds all of it."""
    dims = engines.dims
    if engines.failed or not len(engines) or engines.config.stage >= 3:
        return False
    if dims is not None and (dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        return False
    return any(engines.orig_dtypes.get(name, p.dtype) != p.dtype for name, p in module.named_parameters())


def device_free_bytes(device: torch.device) -> int:
    """What a CUDA device can still hand out: free memory plus what torch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def fits(engines: Engines, module: Module, ranks_per_node: int) -> tuple[bool, str]:
    """(whether every rank has room for the copies, what does not fit); one answer for all ranks (collective), so
    that none starts the gather another skips. The host holds one fp32 copy per rank of the node, within
    :data:`HOST_SHARE` of its free memory; a CUDA device holds, while ``full_state_dict()`` gathers, the full
    masters and their per-parameter copies (twice the fp32 bytes) before they move to the host."""
    named = list(module.named_parameters())
    copy = sum(p.numel() * torch.empty((), dtype=engines.orig_dtypes.get(name, p.dtype)).element_size()
               for name, p in named)
    host_free = available_host_bytes()
    short = ""
    if ranks_per_node * copy > HOST_SHARE * host_free:
        short = (f"fp32 copies on every rank would take {ranks_per_node * copy / 2**30:.1f} GiB of host memory "
                 f"({ranks_per_node} ranks per node), {host_free / 2**30:.1f} GiB are free")
    cuda = next((p.device for _, p in named if p.device.type == "cuda"), None)
    device_free = device_free_bytes(cuda) if cuda is not None else 0
    if not short and cuda is not None and 2 * copy > device_free:
        short = (f"gathering them would take {2 * copy / 2**30:.1f} GiB on {cuda}, "
                 f"{device_free / 2**30:.1f} GiB are free")
    ok = all(C.all_gather_object(not short, None))
    return ok, short or ("another rank has no room" if not ok else "")


def restore_module(engines: Engines, module: Module, full_state_dict: Callable[[], dict[str, torch.Tensor]],
                   ranks_per_node: int) -> bool:
    """Parameters <- fp32 masters, buffers <- their own dtypes, all on the CPU (collective: every rank calls it).
    False, with one warning, where the copies do not fit (:func:`fits`: a model trained under ZeRO need not fit on
    the host once per rank, nor twice in fp32 on its GPU): the module then keeps its 16-bit weights."""
    ok, short = fits(engines, module, ranks_per_node)
    if not ok:
        rank_zero_warn(f"lightning_zero: after fit the module keeps its 16-bit training weights: {short}. "
                       "trainer.strategy.full_state_dict() gives the fp32 masters.")
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
