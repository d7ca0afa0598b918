"""``param.grad`` between backward and the optimizer step: a placeholder that refuses arithmetic.

[Note: gradients in the hooks before the step]
Lightning runs user code between backward and the optimizer step: ``on_before_optimizer_step`` (every
callback's and the module's) and ``configure_gradient_clipping``. Under ddp each ``param.grad`` holds
the averaged gradient there, and code that clips or scales it (``torch.nn.utils.clip_grad_norm_(
self.parameters(), 1.0)``, a hand-written ``p.grad.mul_(...)``) changes the step. Under stages 1-3 the
averaged gradient lives in partitions (rank r holds slice r): ``param.grad`` is None (stages 2-3) or a
local buffer already reduced away (stage 1). Such code would compute a norm of nothing and change
nothing, silently training differently (measured: 0.19 relative apart for a torch clip, 1.08 for a
scaling, tests/callbacks). Materialising full gradients for the hooks would cost what ZeRO saves.

So while those hooks run, each parameter the engines manage holds a :class:`PartitionedGrad` as its
``.grad``: a zero-stride placeholder of the parameter's shape (one shared element of storage) whose
metadata and storage can be read (``is not None``, shape, dtype, memory probes) but whose values
cannot: any other torch operation raises :class:`GradientOutsideStepError`, naming the supported ways
(``gradient_clip_val`` / ``self.clip_gradients``, which the engine applies over the partitions;
``trainer.strategy.grad_norm`` to log the norm). The parameters' own ``.grad`` is put back before the
engine steps. Installed only when such a hook exists (a Python loop over the parameters per step), and
under manual optimization from each ``manual_backward`` to ``opt.step()`` (or the next backward, or the end
of ``training_step``), where the user's own code sits in the same place (strategy.py); under Fabric from
``fabric.backward`` to ``optimizer.step()`` (fabric/strategy.py). Each front door names its own fixes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Iterable, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

ALLOWED = frozenset({
    "shape", "dtype", "device", "size", "dim", "ndim", "numel", "layout", "is_sparse", "is_floating_point",
    "is_complex", "requires_grad", "is_leaf", "grad_fn", "untyped_storage", "data_ptr", "nbytes", "itemsize",
    "element_size", "is_cuda", "is_meta", "stride", "is_contiguous", "grad", "_version", "names", "__set__",
})
"""What code may read from a placeholder (metadata and storage identity, never values)."""


TRAINER_FIXES = (
    "in on_before_optimizer_step, configure_gradient_clipping or after manual_backward, clip with "
    "Trainer(gradient_clip_val=..., gradient_clip_algorithm=...) or self.clip_gradients(optimizer, ...) (applied "
    "by the engine to the whole gradient), read the global norm from trainer.strategy.grad_norm after the step, "
    "or train with strategy='ddp'."
)
FABRIC_FIXES = (
    "after fabric.backward, clip with fabric.clip_gradients(model, optimizer, max_norm=... or clip_val=...) "
    "(applied by the engine to the whole gradient, which also returns the global norm), or use Fabric's 'ddp'."
)


class GradientOutsideStepError(RuntimeError):
    """User code read or changed gradient values between backward and the step under ZeRO stages 1-3."""


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: Tensor.shape.__get__
        owner = getattr(func, "__self__", None)
        return "__set__" if name == "__set__" else getattr(owner, "__name__", name)
    return name


class PartitionedGrad(Tensor):
    """The placeholder ``.grad`` of [Note: gradients in the hooks before the step]."""

    param_name: str = "a parameter"
    fixes: str = ""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[dict] = None) -> Any:
        if _name(func) not in ALLOWED:
            placeholder = next((a for a in _flat(args) if isinstance(a, PartitionedGrad)), None)
            name = placeholder.param_name if placeholder is not None else "a parameter"
            fixes = placeholder.fixes if placeholder is not None else ""
            raise GradientOutsideStepError(
                f"The gradient of '{name}' was used ({_name(func) or func}) between backward and the optimizer step, "
                f"where ZeRO stages 1-3 hold it only in partitions across ranks: {fixes}"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # printing would read values
        return f"PartitionedGrad({self.param_name}, shape={tuple(self.shape)})"


def _flat(args: Any) -> Iterable[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


@contextmanager
def partitioned_grads(params: Iterable[Parameter], names: dict[int, str], fixes: str = TRAINER_FIXES,
                      cache: Optional[dict[int, PartitionedGrad]] = None) -> Generator[None, None, None]:
    """Inside the block each of ``params`` (the engines' managed, non-DTensor parameters) holds a
    :class:`PartitionedGrad`; its own ``.grad`` is restored on exit, whatever happened. ``fixes``: the
    supported ways, as the front door names them (the error's second half). ``cache``: placeholders kept
    by the caller from step to step (measured on a CPU: ~6 us a parameter to build, ~2 us to reuse)."""
    cache = {} if cache is None else cache
    bases: dict[tuple[torch.dtype, torch.device], Tensor] = {}
    saved: list[tuple[Parameter, Optional[Tensor]]] = []
    try:
        with torch._C.DisableTorchFunctionSubclass():  # the setter would dispatch to __torch_function__ per parameter
            for p in params:
                holder = cache.get(id(p))
                if holder is None or holder.shape != p.shape or holder.dtype != p.dtype or holder.device != p.device:
                    key = (p.dtype, p.device)
                    if key not in bases:
                        bases[key] = torch.zeros((), dtype=p.dtype, device=p.device)
                    holder = bases[key].expand(p.shape).as_subclass(PartitionedGrad)
                    holder.param_name = names.get(id(p), "a parameter")
                    holder.fixes = fixes
                    cache[id(p)] = holder
                saved.append((p, p.grad))
                p.grad = holder
        yield
    finally:
        with torch._C.DisableTorchFunctionSubclass():
            for p, g in saved:
                p.grad = g
