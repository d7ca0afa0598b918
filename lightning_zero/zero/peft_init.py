"""peft adapters built on the meta device get peft's own initialisation when they are materialised.

[Note: peft adapters get their own init]
``get_peft_model`` inside ``configure_model`` (the usual way to put LoRA on a model too large for one
rank) creates the adapters on the meta device under ZeRO-3, so peft's init in ``update_layer`` runs on
nothing. ``reset_parameters()`` alone then gives ``lora_B`` torch's nonzero Linear draw where peft (and
so ddp) starts it at zero: the adapted model no longer starts as the base model, and training silently
differs (measured: lora_B max 0.35 instead of 0, 2026-11). So each LoRA layer's adapters are
re-initialised with peft's own ``reset_lora_parameters(adapter, init_lora_weights)``, ``init_lora_weights``
read from the enclosing peft model's ``peft_config`` for that adapter: ``True`` (A kaiming-uniform, B
zeros) and ``"gaussian"`` are replayed; ``False`` (both random) is what ``reset_parameters()`` already
gave. Inits computed from the base weights (PiSSA, OLoRA, LoftQ, CorDA, EVA, ...) and DoRA's magnitude
vector need the full base weight, which a ZeRO-3 unit does not hold while it is materialised: refused in
one line naming the fix (apply ``get_peft_model`` in ``__init__``, or initialise in ``zero_init_module``).
Duck-typed: peft stays an optional dependency.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from torch import nn

Initializer = Callable[[nn.Module], None]

REPLAYABLE = (True, False, "gaussian")
"""``init_lora_weights`` values whose init needs nothing but the adapter's own shape."""


class AdapterInitError(RuntimeError):
    """A peft adapter built on the meta device whose init needs the base weights (PiSSA, DoRA, ...)."""


def _is_lora_layer(module: nn.Module) -> bool:
    return (callable(getattr(module, "reset_lora_parameters", None))
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict))


def _adapter_modules(layer: nn.Module, adapter: str) -> list[nn.Module]:
    out = []
    for attr in ("lora_A", "lora_B"):
        holder = getattr(layer, attr, None)
        if isinstance(holder, nn.ModuleDict) and adapter in holder:
            out.append(holder[adapter])
    return out


def peft_initializers(model: nn.Module) -> dict[int, Initializer]:
    """``id(lora layer) -> init`` for every LoRA layer inside a peft model (nearest ``peft_config``)."""
    found: dict[int, Initializer] = {}
    stack: list[tuple[nn.Module, Optional[Mapping]]] = [(model, None)]
    while stack:
        module, configs = stack.pop()
        own = getattr(module, "peft_config", None)
        if isinstance(own, Mapping):
            configs = own
        if configs is not None and _is_lora_layer(module):
            found[id(module)] = _layer_init(module, configs)
        stack.extend((child, configs) for child in module.children())
    return found


def _layer_init(layer: nn.Module, configs: Mapping) -> Initializer:
    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_lora_parameters")
        for adapter in list(getattr(module, "lora_A").keys()):
            cfg = configs.get(adapter)
            how = getattr(cfg, "init_lora_weights", True)
            if getattr(cfg, "use_dora", False) or how not in REPLAYABLE:
                raise AdapterInitError(
                    f"peft adapter {adapter!r} of a {type(module).__name__} was created on the meta device "
                    f"(get_peft_model inside configure_model under ZeRO-3) with init_lora_weights={how!r}"
                    f"{' and use_dora=True' if getattr(cfg, 'use_dora', False) else ''}, which peft computes from "
                    "the full base weights that a ZeRO-3 unit does not hold here. Apply get_peft_model in __init__ "
                    "(the base model is then built whole), or initialise the adapters in the LightningModule's "
                    "zero_init_module(module) hook."
                )
            if how is not False:
                reset(adapter, how)
    return init


def peft_init_calls(
    modules: list[nn.Module], fresh: set[int], inits: Mapping[int, Initializer]
) -> list[tuple[nn.Module, Initializer]]:
    """The LoRA layers among ``modules`` whose adapter parameters were all just materialised."""
    calls = []
    for module in modules:
        init = inits.get(id(module))
        if init is None:
            continue
        params = [p for a in getattr(module, "lora_A").keys() for m in _adapter_modules(module, a)
                  for p in m.parameters()]
        if params and all(id(p) in fresh for p in params):
            calls.append((module, init))
    return calls


__all__ = ["AdapterInitError", "peft_initializers", "peft_init_calls"]
