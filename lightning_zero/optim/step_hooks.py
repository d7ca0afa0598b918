"""Refusing optimizer step hooks where ``optimizer.step()`` never runs.

[Note: step hooks and steps torch never takes]
16-bit device states (zero/states16.py) and the compiled CPU Adam of offload (offload/host_optimizer.py) update
the masters with their own kernels, not through ``optimizer.step()``: hooks registered with
``optimizer.register_step_pre_hook`` / ``register_step_post_hook`` or torch's global
``register_optimizer_step_pre_hook`` / ``post_hook`` (an EMA of the weights, a logger of the update) would
silently never run, and training would differ from ddp's. Such hooks are refused at setup with one sentence
rather than skipped. (Where the engine does call ``optimizer.step()``, the hooks run, on the flat masters
ZeRO hands the optimizer.)
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as torch_optimizer


def step_hook_count(optimizer: torch.optim.Optimizer) -> int:
    """Hooks that ``optimizer.step()`` would run: the optimizer's own and torch's global ones."""
    own = (len(getattr(optimizer, "_optimizer_step_pre_hooks", {}))
           + len(getattr(optimizer, "_optimizer_step_post_hooks", {})))
    glob = (len(getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}))
            + len(getattr(torch_optimizer, "_global_optimizer_post_hooks", {})))
    return own + glob


def refuse_step_hooks(optimizer: torch.optim.Optimizer, setting: str) -> None:
    """Raise if ``optimizer`` has step hooks that ``setting``'s own step would never run."""
    n = step_hook_count(optimizer)
    if n:
        raise ValueError(f"{setting} updates the weights with its own kernel, not optimizer.step(), so the {n} "
                         f"optimizer step hook(s) registered on {type(optimizer).__name__} (or globally) would never "
                         "run: remove them, or train without it.")
