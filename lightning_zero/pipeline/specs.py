"""Layer specifications: a layer's class and arguments, built only on the stage that holds it.

Names and signatures follow DeepSpeed's ``deepspeed.pipe`` (``LayerSpec(cls, *args, **kwargs)``,
``TiedLayerSpec(key, cls, *args, forward_fn=None, **kwargs)``) because its users know them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)`` must return an ``nn.Module``.

    Why lazily: with ``P`` pipeline stages each rank builds only its own ``1/P`` of the model, so a
    model that does not fit one device (or one host, ``P`` times over) can still be constructed.
    """

    def __init__(self, typename: Callable[..., nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not callable(typename):
            raise TypeError(f"LayerSpec needs a class or callable returning an nn.Module, got {typename!r}.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    @property
    def name(self) -> str:
        return getattr(self.typename, "__name__", type(self.typename).__name__)

    def build(self) -> nn.Module:
        module = self.typename(*self.module_args, **self.module_kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self!r} built a {type(module).__name__}, not an nn.Module.")
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class TiedLayerSpec(LayerSpec):
    """A module shared by several positions of the layer list, e.g. the token embedding reused as the
    output head: ``TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=lambda m, h: F.linear(h, m.weight))``.

    Every spec with the same ``key`` refers to one module, built once per stage that holds any of its
    positions (from the same seed, and broadcast from the first holder, so the copies start equal).
    After backward the gradients of the copies are summed over the stages that hold them, so every
    copy takes the same optimizer step, exactly as the single shared module of an un-pipelined run.
    ``forward_fn(module, x)`` replaces ``module(x)`` at this position when given.
    """

    def __init__(
        self,
        key: str,
        typename: Callable[..., nn.Module],
        *module_args: Any,
        forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None,
        **module_kwargs: Any,
    ) -> None:
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"TiedLayerSpec key must be a non-empty string without '.', got {key!r}.")
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.name})"


__all__ = ["LayerSpec", "TiedLayerSpec"]
