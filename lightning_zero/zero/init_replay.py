"""Init code a model runs on its parameters while it is built on the meta device, recorded and replayed
on the real parameters when ZeRO-3 materialises them.

[Note: init replayed, not guessed]
A model built in ``configure_model`` under ZeRO-3 is built on the meta device, where every init op is a
no-op. Calling each module's ``reset_parameters()`` afterwards gives the constructors' draw, but not
what the model's own ``__init__`` did after building its layers: nanoGPT's ``self.apply(self._init_weights)``
and its scaled ``c_proj`` loop, timm's ``init_weights``, a user's ``nn.init.zeros_(self.head.weight)``.
Built that way, nanoGPT's embedding had std 0.051 (torch's Linear draw, through the tie) where ddp's
has 0.020 (2026-11): silently another model.

So while the model is built, every in-place op applied to a parameter that went to the meta device is recorded
on it, in order, with its arguments: ``nn.init`` functions that dispatch (``normal_``, ``uniform_``,
``kaiming_uniform_``, ...), tensor methods (``normal_``, ``fill_``, ``zero_``, ...), and ops through
``.data``/``detach()`` aliases and views (``weight[padding_idx].fill_(0)``: replayed by re-deriving the view).
``nn.init.trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_``, which neither dispatch nor run on meta
tensors, are wrapped while the context is active. At materialisation the record replays on the real parameter,
after ``reset_parameters()``: the constructor's ops and everything the model did afterwards, in the order it
did them, i.e. the init the model would have had built normally (from other random draws, as under FSDP). An
op that reads another meta tensor (a copy from another parameter built there, PiSSA's SVD of a meta base
weight) cannot be replayed: the parameter keeps the earlier initialisers' values and a warning names it (build
the model in ``__init__``, or initialise it in ``zero_init_module``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

log = logging.getLogger(__name__)

RECORD = "_lightning_zero_init_ops"
"""Attribute of a meta parameter: its recorded ops, or None once one could not be recorded."""

Op = tuple[list[tuple[Callable, tuple, dict]], Callable, tuple, dict, Optional[str]]
"""(view chain from the parameter, in-place function, its other arguments, its keyword arguments, the
keyword the target goes by or None for the first positional argument)."""


NOT_VALUES = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "detach_"})
"""In-place methods that change no value (not recorded)."""


def start_record(param: nn.Parameter) -> None:
    setattr(param, RECORD, [])


def _detached(values: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Real tensor arguments kept by value (the caller may reuse them)."""
    fix = lambda v: v.detach().clone() if isinstance(v, Tensor) else v  # noqa: E731
    return tuple(fix(v) for v in values), {k: fix(v) for k, v in kwargs.items()}


class InitRecorder(TorchFunctionMode):
    """Records in-place ops on recorded meta parameters (directly, through aliases and views)."""

    def __init__(self) -> None:
        super().__init__()
        self._derived: dict[int, tuple[Tensor, nn.Parameter, list]] = {}  # id -> (tensor kept alive, param, chain)

    def _resolve(self, t: object) -> Optional[tuple[nn.Parameter, list]]:
        if not isinstance(t, Tensor) or not t.is_meta:
            return None
        if isinstance(t, nn.Parameter) and hasattr(t, RECORD):
            return t, []
        hit = self._derived.get(id(t))
        return (hit[1], hit[2]) if hit is not None and hit[0] is t else None

    def record(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """Record ``func(target, ...)`` if it writes a recorded parameter in place. The target is the first
        argument, or the ``tensor`` keyword (``nn.init`` functions dispatch with every argument by name)."""
        key: Optional[str] = None
        if args:
            first, rest_args, kw_in = args[0], tuple(args[1:]), dict(kwargs)
        elif "tensor" in kwargs:
            key, first, rest_args = "tensor", kwargs["tensor"], ()
            kw_in = {k: v for k, v in kwargs.items() if k != "tensor"}
        else:
            return
        target = self._resolve(first)
        if target is None:
            return
        param, chain = target
        ops = getattr(param, RECORD)
        if ops is None:
            return
        if any(isinstance(v, Tensor) and v.is_meta for v in tree_flatten((rest_args, kw_in))[0]):
            setattr(param, RECORD, None)  # reads another meta tensor: its value is unknown here
            return
        rest, kw = _detached(rest_args, kw_in)
        ops.append((list(chain), func, rest, kw, key))

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inplace = name == "__setitem__" or (name.endswith("_") and not name.startswith("__") and name not in NOT_VALUES)
        if inplace:
            self.record(func, args, kwargs)
        out = func(*args, **kwargs)
        if not inplace and isinstance(out, Tensor) and out.is_meta and args:
            source = self._resolve(args[0])
            if source is not None and out is not args[0]:
                param, chain = source
                if out._base is None and (name == "__get__" or name == "detach"):  # .data / detach(): same values
                    self._derived[id(out)] = (out, param, chain)
                elif out._base is not None and (out._base is param or id(out._base) in self._derived):
                    self._derived[id(out)] = (out, param, chain + [(func, tuple(args[1:]), dict(kwargs))])
        return out


UNSEEN_INITS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")
"""``nn.init`` functions that neither dispatch to a torch-function mode nor run on meta tensors (they
return early): wrapped while the context is active, so that their calls are recorded whole."""


def _recorded(recorder: InitRecorder, original: Callable) -> Callable:
    def init(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        with torch._C.DisableTorchFunction():  # the call is recorded whole, not the ops inside it
            recorder.record(original, (tensor, *args), kwargs)
            return original(tensor, *args, **kwargs)

    return init


@contextmanager
def recording() -> Generator[InitRecorder, None, None]:
    """The recorder active, with :data:`UNSEEN_INITS` recorded too."""
    recorder = InitRecorder()
    originals = {name: getattr(nn.init, name) for name in UNSEEN_INITS}
    for name, original in originals.items():  # restored below; torch has no hook for these
        setattr(nn.init, name, _recorded(recorder, original))
    try:
        with recorder:
            yield recorder
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def take_record(param: nn.Parameter) -> tuple[bool, list[Op]]:
    """(recorded at all, its ops) of a meta parameter, detached from it; ops None: not replayable."""
    if not hasattr(param, RECORD):
        return False, []
    ops = getattr(param, RECORD)
    delattr(param, RECORD)
    return True, ops


def replay(param: Tensor, ops: list[Op]) -> None:
    """Run the recorded ops on the real ``param``, in order (under no_grad)."""
    with torch.no_grad():
        for chain, func, rest, kw, key in ops:
            target = param
            for view, vargs, vkw in chain:
                target = view(target, *vargs, **vkw)
            if key is None:
                func(target, *rest, **kw)
            else:
                func(*rest, **{key: target}, **kw)


__all__ = ["InitRecorder", "recording", "start_record", "take_record", "replay", "RECORD"]
