"""Finding stage-3 parameters read outside their unit's forward, without user annotation.

[Note: reads outside a unit]
A unit is gathered for its own forward only. Code that reads one of its parameters anywhere else
(a head computing ``F.linear(h, net.emb.weight)`` with ``emb`` in a unit, a regulariser summing
``p.pow(2)`` over all parameters in ``training_step``, a block reaching into another) would meet a
released parameter. During the first step of each kind (training, validation, test, predict) the
strategy runs the step under :class:`ReadWatch`, a ``TorchFunctionMode`` that sees every torch call:
when an argument is a partitioned parameter whose unit is not running, that unit is gathered on the
spot (the read happens at the same point of the program on every rank, so the collective matches)
and made *resident*: from then on it is gathered with the root unit for whole steps (units.py).
The watch covers the whole first batch of each kind (from ``batch_to_device`` to the next batch).
Outside the step method (``on_train_batch_start``, callbacks, ``on_before_optimizer_step``) nothing
can gather for whole steps (the step gathers after those hooks ran), so a read of a released
parameter there raises :class:`ReleasedParameterRead`, which names the parameter, the line and the
fixes, before torch touches the empty storage (some kernels would crash the process). After the
first batch the watch is off (it costs a few microseconds per torch call); a read first made in a
later step reaches torch, whose error :func:`explain_released_read` rewrites. Watched batches run
with torch.compile's stance set to eager (compile.py [Note: first batches run eagerly]).

[Note: reads after a step]
From a step's write-back to the next step's gathers every unit is released (stage3.py ``released_by_step``).
Code that uses a parameter there, the manual-optimization pattern ``opt.step()`` then ``p.data.clamp_()``
(PyTorch's WGAN) above all, would read nothing and write into released storage: the change never reaches
the partitions, so training silently departs from ddp (measured: weights 0.2 apart after 3 steps), or, on a
GPU, the process crashes. ``p.data`` carries the parameter through ``__get__``, so the first batch's watch
sees it and refuses it, naming ``gathered_params(module, writeback=True)``, which does the same edit right.
Only the first batch is watched, and the tensor ``p.data`` returns has a version counter of its own, which
hides a later write from inplace_guard.py [Note: in-place writes outside the optimizer]: a ``.data`` pattern
that starts after the first step is not caught. In-place ops on the parameter itself are, at any step.

[Note: detached aliases]
``p.detach()`` reads no values, so it passes the watch, but the plain tensor it returns shares the released
storage: torch's ``AveragedModel.update_parameters`` (an EMA copy inside the LightningModule, updated in
``on_train_batch_end``) runs ``p_model.detach().to(device)`` and ``p_avg.detach().copy_(...)`` on released
units, a segmentation fault on 2 ranks (found 2026-11). The watch remembers the aliases ``detach`` returns
(weakly) and treats a use of one whose unit is released as a use of its parameter: gathered inside a step
method, refused elsewhere with the messages above. Aliases of gathered units pass, as their parameters would.
"""

from __future__ import annotations

import linecache
import logging
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch.nn import Parameter
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.stage3 import Stage3Engine
    from lightning_zero.zero.units import Unit

log = logging.getLogger(__name__)

METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "requires_grad_", "is_leaf", "grad", "grad_fn", "size", "dim",
    "ndim", "numel", "nelement", "layout", "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_floating_point",
    "is_complex", "element_size", "itemsize", "__hash__", "names", "_version", "untyped_storage", "data_ptr",
    "register_hook", "register_post_accumulate_grad_hook", "__repr__", "__format__", "is_contiguous", "stride",
    "storage_offset", "_base", "output_nr", "retains_grad", "_cdata", "__len__", "detach", "__get__", "__set__",
})
"""Tensor attributes and methods that read no values: released parameters keep these valid."""

RELEASED_READ = "data is not allocated yet"
"""What torch says when a kernel touches a storage resized to zero (a released stage-3 parameter)."""


def _name_of(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property of Tensor: the descriptor carries the attribute name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _params(obj: Any, out: list[Parameter]) -> None:
    if isinstance(obj, Parameter):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _params(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _params(o, out)


class ReleasedParameterRead(RuntimeError):
    """A released ZeRO-3 parameter was read where it cannot be gathered automatically."""


class ReadWatch(TorchFunctionMode):
    """Makes units resident when their parameters are read outside their forward (see the note).

    ``gathering`` is True while a step method runs (the strategy sets it); otherwise a read of a
    released parameter raises :class:`ReleasedParameterRead`."""

    def __init__(self, engines: list["Stage3Engine"]) -> None:
        super().__init__()
        self.gathering = False
        self.owner: dict[int, tuple["Stage3Engine", "Unit"]] = {}
        self.any_unit: dict[int, tuple["Stage3Engine", "Unit"]] = {}
        """Every partitioned parameter, the root unit's too ([Note: reads after a step])."""
        for engine in engines:
            for unit in engine.units:
                for p in unit.params:
                    self.any_unit[id(p)] = (engine, unit)
                    if not unit.is_root:
                        self.owner[id(p)] = (engine, unit)
        self.found: list[str] = []
        self._stance: Optional[Any] = None
        self._aliases: dict[int, tuple[weakref.ref, Parameter]] = {}
        """id(alias) -> (the alias, its parameter) for ``p.detach()`` of partitioned parameters ([Note: detached
        aliases])."""

    @classmethod
    def over(cls, engines: list["ZeroEngine"]) -> Optional["ReadWatch"]:
        """A watch over the engines that gather units (stage 3); None when none does."""
        from lightning_zero.zero.stage3 import Stage3Engine

        gathering = [e for e in engines if isinstance(e, Stage3Engine)]
        return cls(gathering) if gathering else None

    def __enter__(self) -> "ReadWatch":
        """Watched batches run eagerly: dynamo would trace this mode into every compiled unit
        (compile.py [Note: first batches run eagerly])."""
        import torch

        self._stance = torch.compiler.set_stance("force_eager")  # set now; restored by __exit__
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            stance, self._stance = self._stance, None
            if stance is not None:
                stance.__exit__(None, None, None)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        fname = _name_of(func)
        if fname == "detach" and len(args) == 1 and not kwargs and id(args[0]) in self.any_unit:
            return self._remember_alias(args[0], func(*args))
        if fname not in METADATA:
            found: list[Parameter] = []
            _params(args, found)
            _params(kwargs, found)
            if self._aliases:
                self._released_aliases(args, found)
                self._released_aliases(kwargs, found)
            for p in found:
                self._refuse_after_step(p, fname)
                hit = self.owner.get(id(p))
                if hit is None:
                    self._refuse_released_root(p)
                    continue
                engine, unit = hit
                name = engine.param_names.get(id(p), "a parameter")
                if unit.resident or unit.persistent or unit.index in engine.running:
                    continue
                if not self.gathering:
                    if engine.is_gathered(unit):
                        continue
                    raise ReleasedParameterRead(_message(f"parameter {name!r} (unit {unit.name})", _caller()))
                self.found.append(f"{name} (unit {unit.name})")
                log.info("lightning_zero: ZeRO-3 keeps unit %s gathered for whole steps: its parameter %s is read "
                         "outside its forward", unit.name, name)
                engine.make_resident(unit)
            if fname == "data" and getattr(func, "__name__", "") == "__get__" and len(found) == 1:
                result = func(*args, **kwargs)
                hit = self.any_unit.get(id(found[0]))
                if hit is not None and hit[0].is_gathered(hit[1]):  # inplace_guard.py: a write through the alias
                    hit[0].watch_alias(hit[1], found[0], result)
                return result
        return func(*args, **kwargs)

    def _remember_alias(self, param: Parameter, alias: Any) -> Any:
        key = id(alias)
        self._aliases[key] = (weakref.ref(alias, lambda _: self._aliases.pop(key, None)), param)
        return alias

    def _released_aliases(self, obj: Any, out: list[Parameter]) -> None:
        """The parameters of the ``detach()`` aliases in ``obj`` whose unit is released ([Note: detached aliases])."""
        if isinstance(obj, (list, tuple)):
            for o in obj:
                self._released_aliases(o, out)
        elif isinstance(obj, dict):
            for o in obj.values():
                self._released_aliases(o, out)
        elif not isinstance(obj, Parameter) and id(obj) in self._aliases:
            ref, param = self._aliases[id(obj)]
            engine, unit = self.any_unit[id(param)]
            if ref() is obj and not engine.is_gathered(unit) and not unit.persistent:
                out.append(param)

    def _refuse_released_root(self, p: Parameter) -> None:
        """Outside a step method, before the first step (``on_train_batch_start`` of the first batch) the root
        unit is released too: a read there met empty storage (``w.data`` then ``F.normalize``: a segmentation
        fault on the CPU). Refused as a read of any other released unit is."""
        hit = self.any_unit.get(id(p))
        if self.gathering or hit is None or hit[1].persistent or hit[0].is_gathered(hit[1]):
            return
        name = hit[0].param_names.get(id(p), "a parameter")
        raise ReleasedParameterRead(_message(f"parameter {name!r} (unit {hit[1].name})", _caller()))


    def _refuse_after_step(self, p: Parameter, fname: str) -> None:
        """[Note: reads after a step]: between a step and the next forward, a released unit's parameter
        is refused on any use; a gathered one (persistent units) on ``.data`` and in-place ops, whose
        writes the next write-back would discard."""
        hit = self.any_unit.get(id(p))
        if hit is None or not hit[0].released_by_step:
            return
        engine, unit = hit
        if not engine.is_gathered(unit) or fname == "data" or fname.endswith("_"):
            name = engine.param_names.get(id(p), "a parameter")
            raise ReleasedParameterRead(_after_step_message(name, unit.name, _caller()))


def explain_released_read(error: BaseException, released: dict[int, str]) -> Optional[str]:
    """A clear message for torch's error on a released parameter (None for any other error).

    ``released`` maps id(param) -> name of every partitioned parameter. The traceback's frames are
    searched for one of them (a Python-level Tensor method has the parameter as ``self``), and the
    innermost frame outside torch names the line that read it.
    """
    if not isinstance(error, RuntimeError) or RELEASED_READ not in str(error):
        return None
    names: list[str] = []
    where = ""
    tb: Optional[TracebackType] = error.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            if isinstance(value, Parameter) and id(value) in released and released[id(value)] not in names:
                names.append(released[id(value)])
        file = frame.f_code.co_filename
        if not where and "/torch/" not in file and "/lightning/" not in file and "/lightning_zero/" not in file:
            code = linecache.getline(file, frame.f_lineno).strip()
            where = f"{file}:{frame.f_lineno} (in {frame.f_code.co_name}): `{code}`"
    what = f"parameter {', '.join(repr(n) for n in names)}" if names else "a parameter partitioned by ZeRO stage 3"
    return _message(what, where) + f" (torch: {str(error).splitlines()[0]})"


def _caller() -> str:
    """The innermost frame outside torch, Lightning and lightning_zero: the user's line."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not any(part in file for part in ("/torch/", "/lightning/", "/lightning_zero/", "/lightning_utilities/")):
            code = linecache.getline(file, frame.f_lineno).strip()
            return f"{file}:{frame.f_lineno} (in {frame.f_code.co_name}): `{code}`"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def _after_step_message(name: str, unit: str, where: str) -> str:
    """[Note: reads after a step]: a parameter used between ``optimizer.step()`` and the next step's forward."""
    return (
        f"ZeRO-3: parameter {name!r} (unit {unit}) was used after optimizer.step() and before the next forward, at "
        f"{where or 'an unknown place'}. Stage 3 releases its units at the step (small persistent ones are gathered "
        "again, and the next step discards changes to them), so a read there finds no values and a write (WGAN's "
        "`p.data.clamp_()`) would be lost, where ddp keeps it. Fix: do it inside `with strategy.gathered_params(module, "
        "writeback=True):` (`trainer.strategy` or `fabric.strategy`; every rank must enter it; it writes your changes "
        "back into the partitions), or use stage 1 or 2, which follow such writes."
    )


def _message(what: str, where: str) -> str:
    return (
        f"ZeRO-3: {what} was read while its unit was released, at {where or 'an unknown place'}. Inside "
        "training_step/validation_step/test_step/predict_step a read outside the unit's own forward is found in the "
        "first step and that unit is then kept gathered; this read happened elsewhere (a callback or hook such as "
        "on_train_batch_start, or only in a later step). Fix: read it inside "
        "`with trainer.strategy.gathered_params(module):` (every rank must enter it), or choose the units yourself "
        "so that this module is not one: ZeroStrategy(stage=3, unit_policy=[...class names...])."
    )

