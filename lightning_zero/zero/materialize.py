"""Sharded initialisation for ZeRO-3: build on the meta device, materialise one unit at a time.

Inside ``ZeroStrategy.model_sharded_context`` (Lightning enters it around ``configure_model``)
every parameter registered on a module is replaced by a meta-device copy as soon as it is created,
so building a model costs at most one parameter's memory, whatever its total size. Buffers stay
real (they are small, and values computed in ``__init__`` such as masks would otherwise be lost).
A parameter that replaces one holding values stays real: see [Note: the user's weights are kept].

The engine then materialises the model unit by unit (:func:`materialize_unit`): each meta parameter
is swapped in place for an empty real one (``torch.utils.swap_tensors`` keeps the Python object, so
optimizers built from it still point at it), its module's ``reset_parameters()`` runs, then, inside a
Hugging Face model, that model's own ``_init_weights`` ([Note: Hugging Face models get their own
init]), then the init ops the model's own ``__init__`` ran, recorded while it was built (init_replay.py
[Note: init replayed, not guessed]), then the LightningModule's optional ``zero_init_module(module)``
hook, and the unit is sharded before the next one is materialised. Every rank runs the same initialisation with the
same seed, so each keeps a consistent shard of one and the same model.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Generator, Mapping, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.zero.init_replay import recording, replay, start_record, take_record
from lightning_zero.zero.peft_init import peft_init_calls, peft_initializers
from lightning_zero.zero.units import Unit

log = logging.getLogger(__name__)

_INIT_VALUE = "_lightning_zero_init_value"
"""Attribute of a meta parameter holding the value it was created with (see params_on_meta)."""


_LOAD_GUARD = "_lightning_zero_meta_load_guard"
"""Attribute marking a module whose ``load_state_dict`` into meta parameters is refused."""


class MetaLoadError(RuntimeError):
    """``load_state_dict`` (without ``assign=True``) into parameters on the meta device: a silent no-op."""


def _refuse_load_into_meta(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: object
) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        return  # assign=True registers the loaded tensors: kept ([Note: the user's weights are kept])
    lost = [prefix + n for n, p in module.named_parameters(recurse=False) if p.is_meta and prefix + n in state_dict]
    if lost:
        raise MetaLoadError(
            f"load_state_dict into {lost[:3]}{'...' if len(lost) > 3 else ''}, built on the meta device inside "
            "configure_model (ZeRO-3 sharded initialisation), would copy nothing (torch only warns), and the weights "
            "would be initialised afresh. Load with load_state_dict(state_dict, assign=True) (the loaded tensors are "
            "kept), or build or load the model in __init__, or resume from a checkpoint (trainer.fit(ckpt_path=...))."
        )


@contextmanager
def params_on_meta(existing: Optional[nn.Module] = None) -> Generator[None, None, None]:
    """Register parameters on the meta device while the block runs, except those holding values that
    replace a registered parameter, and the parameters of ``existing`` (the LightningModule, whose
    ``__init__`` may have built or loaded weights) registered again ([Note: the user's weights are kept]).

    [Note: the user's weights are kept]
    Lightning's ModelParallelStrategy pattern builds (or loads) the weights in ``__init__`` and only
    parallelizes them in ``configure_model``, which runs inside this context. ``parallelize_module``
    re-registers every split weight as a new DTensor parameter (``register_parameter(name,
    Parameter(distribute_tensor(old)))``), and so does any ``module.weight = Parameter(f(module.weight))``
    rewrite, a tie to a weight that exists (``head.weight = embed.weight``) or
    ``load_state_dict(sd, assign=True)`` on a model built here. Sending those to the meta device lost
    the values: the materialiser then ran ``reset_parameters()``, so stage 3 x TP trained from fresh
    random weights (first loss 4.986 instead of 5.049, 2026-11). The hook runs before the registration,
    so the slot still holds the old parameter: a real parameter replacing one keeps its values (and its
    memory: the user computed them), as does a parameter that existed before the context
    (``existing``'s) registered in a slot of its own. Only parameters a constructor creates inside the
    context (a model built in ``configure_model``) go to meta: initialising those is ours. A
    ``load_state_dict`` without ``assign`` into them would copy nothing (torch only warns): refused
    (:class:`MetaLoadError`). ``materialize_modules`` puts real parameters back after a
    ``reset_parameters()`` that also covered them.
    """
    # held (not only their ids) so that no new object made inside the block can take one of their ids
    before = {id(p): p for _, p in existing.named_parameters(remove_duplicate=False)} if existing is not None else {}

    def to_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
        if param is None or param.is_meta:
            return None
        if module._parameters.get(name) is not None or id(param) in before:  # the user's values
            return None
        meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        start_record(meta)  # what the model does to it from here on is replayed ([Note: init replayed, not guessed])
        if not callable(getattr(module, "reset_parameters", None)):
            # nothing could re-create this value (``nn.Parameter(torch.ones(d))`` in a norm): keep it,
            # on the host, for materialize_modules ([Note: no uninitialised parameters])
            setattr(meta, _INIT_VALUE, param.detach().to("cpu", copy=True))
        if not module.__dict__.get(_LOAD_GUARD, False):
            module.register_load_state_dict_pre_hook(_refuse_load_into_meta)
            setattr(module, _LOAD_GUARD, True)
        return meta

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        with recording():
            yield
    finally:
        handle.remove()


def has_meta_params(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _modules_of(model: nn.Module, unit: Unit, units: list[Unit]) -> list[nn.Module]:
    if unit.module is not None:
        return list(unit.module.modules())
    inside = {id(m) for u in units if u.module is not None for m in u.module.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def _has_storage(p: torch.Tensor) -> bool:
    """Not a released ZeRO-3 parameter (storage resized to nothing)."""
    return local_tensor(p).untyped_storage().nbytes() > 0


Initializer = Callable[[nn.Module], None]


def _is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (duck-typed: transformers stays an optional dependency)."""
    return (callable(getattr(module, "_init_weights", None)) and callable(getattr(module, "post_init", None))
            and getattr(module, "config", None) is not None)


def hf_initializers(model: nn.Module) -> dict[int, Initializer]:
    """``id(module) -> init`` for every module a Hugging Face model's ``post_init`` initialised (flagged
    ``_is_hf_initialized``): the nearest enclosing ``PreTrainedModel``'s ``_init_weights`` (a nested
    sub-model uses its own, as transformers' ``initialize_weights`` dispatches). Computed once per model
    ([Note: Hugging Face models get their own init])."""
    found: dict[int, Initializer] = {}
    stack: list[tuple[nn.Module, Optional[Initializer]]] = [(model, None)]
    while stack:
        module, init = stack.pop()
        if _is_hf_model(module):
            init = module._init_weights  # type: ignore[assignment]
        if init is not None and getattr(module, "_is_hf_initialized", False):  # post_init visited it
            found[id(module)] = init
        stack.extend((child, init) for child in module.children())
    return found


def _hf_init_calls(
    modules: list[nn.Module], fresh: set[int], held: set[int], hf_inits: Mapping[int, Initializer]
) -> list[tuple[nn.Module, Initializer]]:
    """The ``(module, its model's _init_weights)`` calls that give the fresh parameters of ``modules``
    Hugging Face's initialisation, children before parents (as ``initialize_weights`` runs them).

    [Note: Hugging Face models get their own init]
    A ``PreTrainedModel`` built in ``configure_model`` initialises its weights in ``post_init``:
    ``initialize_weights`` applies ``_init_weights`` to every module (normal(0, initializer_range) for
    Linear and Embedding, ones/zeros for norms, GPT-2's c_proj scaled by 1/sqrt(2 n_layer), set by the
    *parent* attention/MLP module by name), overriding what the constructors drew. Built on the meta
    device it ran on nothing; then ``reset_parameters()`` alone gave torch's defaults (q_proj std 0.072
    and embedding std 0.99 where ddp's Llama has 0.02: silently a different model, 2026-11). So after
    ``reset_parameters()`` (the constructors' draw, kept for what ``_init_weights`` does not cover) the
    nearest enclosing ``PreTrainedModel``'s ``_init_weights`` runs on each module with a fresh
    parameter in its subtree, children first: HF's distribution, not ddp's draw (another RNG order, as
    under FSDP). ``_init_weights`` is called directly: ``_initialize_weights`` would skip every module,
    since ``post_init`` on meta already flagged them ``_is_hf_initialized``. That flag also tells which
    modules ``post_init`` covered: one added afterwards (peft's LoRA layers, a replaced head) is left to
    its own ``reset_parameters()``, as under ddp, not given HF's init. A module is called only
    when every parameter it could write is fresh, held here (real, put back afterwards: [Note: the
    user's weights are kept]) or still meta (a later unit's: a no-op); a released ZeRO-3 shard (no
    storage) must never be written (a crash) and another unit's real weights are not ours.
    """
    calls = []
    for module in reversed(modules):  # the reverse of a pre-order: every child before its parent
        init = hf_inits.get(id(module))
        if init is None:
            continue
        params = list(module.parameters())
        if any(id(p) in fresh for p in params) and all(
            id(p) in fresh or id(p) in held or p.is_meta for p in params
        ):
            calls.append((module, init))
    return calls


class UninitializedParameterError(RuntimeError):
    """A parameter built on the meta device that nothing initialised when it was materialised."""


def materialize_modules(
    modules: list[nn.Module], device: torch.device, init_hook: Optional[Initializer] = None,
    hf_inits: Optional[Mapping[int, Initializer]] = None, peft_inits: Optional[Mapping[int, Initializer]] = None,
) -> None:
    """Give every meta parameter of ``modules`` real storage and initialise it. ``hf_inits``: from
    :func:`hf_initializers` of the whole model (by default, of ``modules[0]``, the whole model when
    ``modules`` is ``list(model.modules())``).

    [Note: no uninitialised parameters]
    A materialised parameter gets its value from, in order: the value it was created with, kept by
    :func:`params_on_meta` when its module has no ``reset_parameters`` (a norm's ``torch.ones``);
    its module's ``reset_parameters()``; inside a Hugging Face model, that model's ``_init_weights``
    ([Note: Hugging Face models get their own init]); for a peft LoRA layer, peft's own adapter init
    (peft_init.py [Note: peft adapters get their own init]); the LightningModule's ``zero_init_module(module)`` hook.
    Floating-point storage starts as NaN and is checked afterwards: a parameter none of these set
    (created on the meta device by the user, or one ``reset_parameters`` does not cover) is an error
    naming it, never silent garbage.
    """
    touched = []
    fresh: list[tuple[str, nn.Parameter]] = []
    records: list[tuple[str, nn.Parameter, Optional[list]]] = []
    # a reset_parameters() below resets every parameter of its module (a parent's, its children's too):
    # the real ones among them are the user's ([Note: the user's weights are kept]), put back afterwards
    own = {id(p): p for m in modules for p in m.parameters(recurse=False)}
    held = [(p, p.detach().clone()) for p in own.values() if not p.is_meta and _has_storage(p)] if any(
        p.is_meta for p in own.values()) else []
    for module in modules:
        mine = False
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                init = getattr(p, _INIT_VALUE, None)
                recorded, ops = take_record(p)
                if recorded:
                    records.append((f"{type(module).__name__}.{name}", p, ops))
                real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                with torch.no_grad():
                    if init is not None:
                        real.copy_(init)
                    elif real.is_floating_point():
                        real.fill_(float("nan"))
                torch.utils.swap_tensors(p, real)
                if hasattr(p, _INIT_VALUE):
                    delattr(p, _INIT_VALUE)
                fresh.append((f"{type(module).__name__}.{name}", p))
                mine = True
        if mine:
            touched.append(module)
    if hf_inits is None:
        hf_inits = hf_initializers(modules[0]) if modules else {}
    hf_calls = _hf_init_calls(modules, {id(p) for _, p in fresh}, {id(p) for p, _ in held}, hf_inits)
    if peft_inits is None:
        peft_inits = peft_initializers(modules[0]) if modules else {}
    peft_calls = peft_init_calls(modules, {id(p) for _, p in fresh}, peft_inits)
    with torch.no_grad():
        for module in touched:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
        for module, init in hf_calls:
            init(module)
        for module, init in peft_calls:  # after HF's: _init_weights would redraw lora_B too
            init(module)
        for _, p, ops in records:  # what the model's own __init__ did, in its order (init_replay.py)
            if ops:
                replay(p, ops)
        for p, value in held:
            p.copy_(value)
        for module in touched:
            if init_hook is not None:
                init_hook(module)
    lost = [name for name, _, ops in records if ops is None]
    if lost:
        log.warning(
            "lightning_zero: the init the model ran on %s while it was built on the meta device read other meta "
            "tensors (e.g. orthogonal_ or an SVD) and cannot be replayed: they keep their modules' own init. Build "
            "the model in __init__, or initialise them in the LightningModule's zero_init_module(module) hook.",
            lost[:5])
    unset = [name for name, p in fresh if p.is_floating_point() and bool(torch.isnan(p).any())]
    if unset:
        raise UninitializedParameterError(
            f"Parameter(s) {unset[:5]}{'...' if len(unset) > 5 else ''} were built on the meta device (ZeRO-3 "
            "sharded initialisation) and nothing initialised them when they were materialised: neither their "
            "module's reset_parameters() nor a Hugging Face model's _init_weights covers them, and the "
            "LightningModule's zero_init_module(module) hook did not set them (or set NaN). Give the module a "
            "reset_parameters(), initialise them in zero_init_module, or create them outside configure_model."
        )


def make_unit_materializer(
    model: nn.Module, device: torch.device, init_hook: Optional[Callable] = None
) -> Callable[[Unit, list[Unit]], None]:
    """A callback for Stage3Engine: materialise the modules of one unit (root: those outside all units)."""
    hf_inits, peft_inits = hf_initializers(model), peft_initializers(model)

    def materialize(unit: Unit, units: list[Unit]) -> None:
        materialize_modules(_modules_of(model, unit, units), device, init_hook, hf_inits, peft_inits)

    return materialize


def has_meta_tensors(module: Optional[nn.Module]) -> bool:
    """Whether a module built in ``configure_model`` is still on the meta device (setup failed before the engines
    materialised it): Lightning's teardown would move it to the CPU and raise "Cannot copy out of meta tensor", hiding
    the error that stopped setup (the strategy's teardown asks)."""
    if module is None:
        return False
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))
