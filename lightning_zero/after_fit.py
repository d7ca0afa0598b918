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
module. The engines stay, so ``trainer.save_checkpoint()`` after fit still saves their shards; a later
``validate``/``test``/``fit`` sets the module up again.

Not under stage 3 (its parameters are released; ``state_dict()`` there is refused naming ``full_state_dict()``,
zero/released_guard.py) nor with tensor, pipeline or expert parallelism (a rank holds part of the module);
nothing to do under ``32-true`` or ``mixed_precision="autocast"`` (the module is fp32 and equal to the masters).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import Module

from lightning_zero.engines import Engines


def needs_restore(engines: Engines, module: Module) -> bool:
    """Whether the module holds parameters in another dtype than the user built them (the cast layout), under
    a layout where every rank holds all of it."""
    dims = engines.dims
    if engines.failed or not len(engines) or engines.config.stage >= 3:
        return False
    if dims is not None and (dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        return False
    return any(engines.orig_dtypes.get(name, p.dtype) != p.dtype for name, p in module.named_parameters())


def restore_module(engines: Engines, module: Module, full_state_dict: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Parameters <- fp32 masters, buffers <- their own dtypes, all on the CPU (collective: every rank calls it)."""
    full = full_state_dict()  # the masters in the user's dtypes, on the CPU, every rank
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.data = full[name]
            p.grad = None
        for name, b in module.named_buffers():
            want = engines.orig_buffer_dtypes.get(name, b.dtype)
            b.data = full[name] if name in full else b.data.to("cpu", want)
    module.cpu()  # anything left (a buffer of no state dict, not floating)
