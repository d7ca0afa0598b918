"""torch.compile under every ZeRO stage: units compiled one by one, stage 3's hooks outside them.

[Note: hooks outside compiled regions]
Stage 3 gathers a unit in its forward pre-hook and releases it in its forward post-hook: collectives,
storage resizes, autograd hooks on the outputs, Python bookkeeping of the recorded order. None of it
can be traced, and a traced hook breaks the graph at every unit. So the hooks are wrapped in
``torch._dynamo.disable`` (stage3.py's ``_outside_compile``) and the compiled regions are the units'
forwards, as FSDP2 with torchtitan's per-block compile does:

* a unit is compiled with ``module.compile(**options)``, which compiles the module's ``_call_impl``;
  dynamo does not trace ``_call_impl`` itself (a torch.nn frame), so the disabled hooks run eagerly
  around the one compiled frame of the unit's ``forward``. ``fullgraph=True`` holds for that frame;
* all units of one class share one graph (parameters are graph inputs, not constants): a model of
  24 blocks compiles the block once (and once more in eval/no-grad mode);
* what runs outside every unit (embeddings, a tied head, the final norm, the loss) runs eagerly
  under ``compile=True``; under the user's whole-network compile its modules are compiled too
  ([Note: the user's compile under stage 3]); below stage 3 there are no unit hooks and the user's
  compile is left as it is;
* a module of torch.nn itself (a ``Linear`` unit of ``nn.Sequential(Linear, GELU, Linear)`` blocks,
  which the unit policy walks into) cannot be compiled through ``_call_impl``: dynamo skips torch.nn's
  frames when they are the outermost one (``fullgraph=True`` then fails with "found no compiled
  frames", and without it nothing is compiled). Its ``forward`` is called through a frame of ours
  instead (:func:`compile_module`), one code object per module, so dynamo's per-code recompile limit
  is never shared between them.

[Note: the user's compile under stage 3]
A user who compiles the whole network (``self.model = torch.compile(net)``, ``net.compile()`` or
``self.compile()`` on the LightningModule) would have dynamo trace into the block loop, meet the
first disabled hook, give up on the loop's frame ("graph break in loop": the frame runs eagerly) and
compile each unit's frame on its own: correct, but it fails under ``fullgraph=True`` and depends on
how a given torch version handles a break inside a loop. So the strategy makes that choice itself:
under stage 3 a compiled module that *contains* units is made eager (an ``OptimizedModule`` keeps its
place, so state-dict keys keep their ``_orig_mod.`` part, but calls its original module; a
``.compile()``d module drops its ``_compiled_call_impl``) and each unit is compiled with the user's
own compile context (backend, mode, ``fullgraph``...), and so is every part of that module outside
all units (the largest subtrees holding no unit: embeddings, norms, a head, activation modules
between units), so that what the user compiled is compiled, piece by piece (dynamo's own counters
show it: ``calls_captured`` as under ddp's whole-network compile for a network whose units differ,
fewer where identical units share one graph). Only code written directly in a ``forward`` that calls
units (a residual add in the block loop, a ``F.linear`` with a tied weight) runs eagerly: dynamo would
meet the units' disabled hooks there. A part runs compiled only when it is called while that
module's forward runs (:class:`_Inside`), as it would under the user's compile: a metric or a loss
module held by a compiled LightningModule and called from ``training_step`` stays eager. Units the
user compiled one by one (``block.compile(...)``, ``torch.compile(block)``) are left as they are:
their hooks are already outside. ``ZeroConfig.compile=True`` compiles every unit that is not
compiled yet, under any stage (below stage 3 the units are the repeated blocks units.py's default
policy, or ``unit_policy``, finds; a model without any: its top-level children).

[Note: first batches run eagerly]
During the first batch of each kind, stage 3 runs under read_watch.py's ``ReadWatch``, a
``TorchFunctionMode`` that dynamo would trace into every graph (its bookkeeping becomes guards that
fail unit after unit: one recompilation per unit, past dynamo's recompile limit for a deep model).
ReadWatch therefore sets ``torch.compiler.set_stance("force_eager")`` while it watches: those
batches run eagerly and compilation starts with the second batch.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_zero.config.strategy import ZeroConfig
from lightning_zero.zero.units import Unit, find_units

log = logging.getLogger(__name__)

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Turns a function into its compiled form: ``functools.partial(torch.compile, **options)`` or a
dynamo context taken from the user's own compile."""


def _optimized_module_type() -> type:
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


_COMPILED_FORWARD = "_lightning_zero_compiled_forward"
"""Instance attribute set on a torch.nn module whose ``forward`` :func:`compile_module` compiled."""


def is_compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` enters a compiled region (``module.compile()``, ``torch.compile(module)``
    or :func:`compile_module`)."""
    return (module._compiled_call_impl is not None or isinstance(module, _optimized_module_type())
            or _COMPILED_FORWARD in module.__dict__)


def compiler_from_options(options: dict[str, Any]) -> Compiler:
    """``torch.compile`` with ``options`` (its keyword arguments: backend, mode, fullgraph, dynamic, options)."""
    return functools.partial(torch.compile, **options)


def dynamo_context_of(compiled_fn: Callable[..., Any]) -> Optional[Compiler]:
    """The dynamo context behind a function ``torch.compile`` returned (what ``module.compile()`` stores
    in ``_compiled_call_impl``), so that units are compiled exactly as the user asked; None if this torch
    keeps it elsewhere (the caller then falls back to default options)."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled_fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value  # type: ignore[return-value]
    return None


def _call_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The frame dynamo compiles for a torch.nn module (its own frames are on dynamo's skip list)."""
    return forward(*args, **kwargs)


def _forward_frame(module: nn.Module) -> Callable[..., Any]:
    """A fresh copy of :func:`_call_forward` with a code object of its own (dynamo keeps its compiled
    graphs and its recompile limit per code object), named after the module's class."""
    code = _call_forward.__code__.replace(co_name=f"{type(module).__name__}_forward")
    return types.FunctionType(code, _call_forward.__globals__, code.co_name)


class _Inside:
    """Whether the forward of a module the user compiled whole (now eager) is running: the parts of it
    outside the units run compiled only then ([Note: the user's compile under stage 3])."""

    ATTR = "_lightning_zero_inside"

    def __init__(self) -> None:
        self.depth = 0

    @classmethod
    def of(cls, module: nn.Module) -> "_Inside":
        """The tracker of ``module``, its forward hooks installed once (setup runs again for validate)."""
        inside = module.__dict__.get(cls.ATTR)
        if inside is None:
            inside = cls()
            setattr(module, cls.ATTR, inside)
            module.register_forward_pre_hook(torch.compiler.disable(inside._enter))
            module.register_forward_hook(torch.compiler.disable(inside._leave), always_call=True)
        return inside

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1


def _dispatch(compiled: Callable[..., Any], eager: Callable[..., Any], inside: _Inside) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return (compiled if inside.depth else eager)(*args, **kwargs)

    return call


def compile_module(module: nn.Module, compiler: Compiler, only_inside: Optional[_Inside] = None) -> None:
    """``module.compile()`` with ``compiler``: its forward becomes one compiled frame, its hooks run
    eagerly around it ([Note: hooks outside compiled regions]). A module of torch.nn itself gets its
    ``forward`` compiled through a frame of ours instead (see the first note). ``only_inside``: run
    compiled only while that tracker's module runs its forward, eagerly elsewhere."""
    if not _torch_builtin(module):
        compiled = compiler(module._call_impl)
        eager = module._call_impl
        module._compiled_call_impl = compiled if only_inside is None else _dispatch(compiled, eager, only_inside)
        return
    compiled = functools.partial(compiler(_forward_frame(module)), module.forward)
    forward = compiled if only_inside is None else _dispatch(compiled, module.forward, only_inside)
    module.forward = forward  # type: ignore[method-assign]
    setattr(module, _COMPILED_FORWARD, True)


@dataclass
class CompilePlan:
    """What :func:`apply_compile` did (logged once; tests read it)."""

    compiled: list[str] = field(default_factory=list)
    """Names of the modules compiled one by one now."""
    made_eager: list[str] = field(default_factory=list)
    """Stage 3: names of the user's compiled modules that contain units, now called eagerly."""
    already_compiled: list[str] = field(default_factory=list)
    """Units the user compiled one by one (left as they are)."""
    compiled_around: list[str] = field(default_factory=list)
    """Stage 3: the parts of a module in ``made_eager`` outside every unit, compiled one by one."""


def _make_eager(module: nn.Module) -> Optional[Compiler]:
    """Stop ``module`` entering a compiled region when called; return the compile context it had."""
    if isinstance(module, _optimized_module_type()):
        ctx = module.dynamo_ctx
        module.forward = module._orig_mod.__call__  # the OptimizedModule stays (state-dict keys unchanged)
        return ctx  # type: ignore[no-any-return]
    compiled = module._compiled_call_impl
    module._compiled_call_impl = None
    return dynamo_context_of(compiled) if compiled is not None else None


def compile_targets(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules compiled one by one: the units; without any, the layers this rank holds of a
    PipelineModule (whose own forward runs the schedule, with its sends and receives), else the model's
    top-level children that hold parameters (a model with no repeated blocks is still compiled)."""
    from lightning_zero.pipeline.module import PipelineModule

    if units:
        return list(units)
    targets: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, PipelineModule):
            targets += [(f"{name}.layers.{i}", m) for i, m in module.layers.named_children() if _has_params(m)]
    if targets:
        return targets
    return [(n, m) for n, m in model.named_children() if _has_params(m)]


def _torch_builtin(module: nn.Module) -> bool:
    """A module of torch.nn itself (a Linear unit, a LayerNorm made a unit by ``unit_policy``): dynamo
    does not trace its frames on their own (see the first note)."""
    return type(module).__module__.startswith("torch.")


def _unit_free_parts(module: nn.Module, prefix: str, unit_ids: set[int],
                     holds_unit: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """The largest subtrees of ``module`` holding no unit (units and uncallable containers excluded),
    in module order: what the user's compile of ``module`` covered besides the units."""
    parts: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if id(child) in unit_ids:
            continue
        if holds_unit(child):
            parts += _unit_free_parts(child, full, unit_ids, holds_unit)
        elif type(child) not in (nn.ModuleList, nn.ModuleDict):  # those are never called
            parts.append((full, child))
    return parts


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def apply_compile(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    stage3: bool,
    options: Optional[dict[str, Any]],
) -> CompilePlan:
    """Compile ``units`` one by one (see the notes above). ``options``: ``torch.compile`` keyword
    arguments when the strategy's ``compile`` is on, else None (then only a stage-3 redirection of the
    user's own compile happens). Idempotent: setup runs again for validate/test."""
    plan = CompilePlan()
    compiler: Optional[Compiler] = compiler_from_options(options) if options is not None else None
    targets = compile_targets(model, units)
    parts: list[tuple[str, nn.Module, _Inside]] = []
    if stage3 and units:
        unit_ids = {id(m) for _, m in units}
        inside: dict[int, bool] = {}

        def holds_unit(module: nn.Module) -> bool:
            if id(module) not in inside:
                inside[id(module)] = any(id(m) in unit_ids for m in module.modules() if m is not module)
            return inside[id(module)]

        for name, module in model.named_modules():
            if id(module) in unit_ids or not is_compiled(module) or not holds_unit(module):
                continue
            ctx = _make_eager(module)
            plan.made_eager.append(name or type(module).__name__)
            tracker = _Inside.of(module)
            parts += [(n, m, tracker) for n, m in _unit_free_parts(module, name, unit_ids, holds_unit)]
            if compiler is None:
                if ctx is None:
                    log.warning("lightning_zero: could not read the compile options of %s; its ZeRO-3 units are "
                                "compiled with torch.compile's defaults", name or type(module).__name__)
                compiler = ctx if ctx is not None else compiler_from_options({})
    for name, module in targets:
        if is_compiled(module):
            plan.already_compiled.append(name)
        elif compiler is not None:
            compile_module(module, compiler)
            plan.compiled.append(name)
    if plan.made_eager and compiler is not None:  # the rest of what the user compiled, piece by piece
        seen: set[int] = set()
        for name, module, tracker in parts:
            if id(module) not in seen and not is_compiled(module):
                seen.add(id(module))
                compile_module(module, compiler, only_inside=tracker)
                plan.compiled_around.append(name)
    if plan.made_eager:
        log.info("lightning_zero: ZeRO-3 compiles units one by one (%d) and the %d parts of %s outside them; the "
                 "user's compile of the whole now calls them eagerly (lightning_zero/zero/compile.py [Note: the "
                 "user's compile under stage 3])",
                 len(plan.compiled), len(plan.compiled_around), ", ".join(plan.made_eager))
    return plan


def compile_for_strategy(model: nn.Module, stage3_units: Sequence[Unit], config: ZeroConfig) -> Optional[CompilePlan]:
    """The strategy's call (after its engines exist): stage 3 compiles or redirects onto its engine's
    units; below stage 3 ``compile=True`` compiles the blocks ``unit_policy`` finds. None: nothing to do."""
    options = dict(config.compile_options or {}) if config.compile else None
    if stage3_units:
        units = [(u.name, u.module) for u in stage3_units if u.module is not None]
    elif options is not None:
        units = [(u.name, u.module) for u in find_units(model, config.unit_policy)[1:] if u.module is not None]
    else:
        return None
    return apply_compile(model, units, stage3=bool(stage3_units), options=options)


__all__ = ["CompilePlan", "apply_compile", "compile_for_strategy", "compile_module", "compile_targets", "dynamo_context_of", "is_compiled"]
