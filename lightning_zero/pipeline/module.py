"""PipelineModule: a model written as a list of layers, run in sequence or as pipeline stages.

``self.pipe = PipelineModule([LayerSpec(...), ...], loss_fn)`` in a LightningModule, and
``loss = self.pipe((inputs, labels))`` in its steps. Under a strategy without pipeline stages the
layers run one after the other and the loss comes back with its graph, as from any module. Under
``ZeroStrategy(pipeline_stages=P)`` the strategy places the module (each rank builds and keeps only
its stage's layers) and attaches a runtime, and the same call runs a whole pipeline schedule
(forward and backward of every micro-batch) and returns the loss averaged over micro-batches.

[Note: lazy construction]
Layers given as :class:`LayerSpec` are built by :meth:`PipelineModule.materialize` only, for the
parts of the layer list that a stage holds. The strategy calls it as soon as it knows the stage
(``setup_environment``, before Lightning's hooks touch the module). Anything that needs the layers
before that (``parameters()``, ``state_dict()``, ``.to()``, a forward) builds all of them, which is
what a run without pipeline stages wants; a later placement onto a stage then drops the other
stages' layers. Building order does not change the weights: with ``seed_layers`` (the default),
layer ``i`` is built from its own seed ``base_seed + i``, where ``base_seed`` is drawn from torch's
generator when the PipelineModule is constructed, so a stage that builds layers 3..5 gets the same
values as a single process building 0..5, and seeding before construction makes runs reproducible.

[Note: state-dict names]
Layer ``i`` is registered as ``layers.<i>`` and a tied module as ``tied.<key>`` on every stage that
holds it, so a stage's state dict is a subset of the un-pipelined one under the same names: the
strategy merges the stages' subsets into one checkpoint that loads into an un-pipelined run, and a
stage loading a full checkpoint skips the keys of layers it does not hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.activations.recompute import replay_buffers
from lightning_zero.pipeline import partition as split_math
from lightning_zero.pipeline.specs import LayerSpec, TiedLayerSpec

LayerLike = Union[LayerSpec, nn.Module, Callable[[Any], Any]]


class Runtime(Protocol):
    """What the strategy attaches to run the pipeline (see ``runtime.PipelineRuntime``)."""

    def run(self, inputs: Any, labels: Any) -> Tensor: ...

    def predict(self, inputs: Any) -> Any: ...


@dataclass(frozen=True)
class Placement:
    """Where the layers live: ``num_stages`` ranks x ``chunks`` model chunks per rank.

    Part ``p`` (``p = chunk * num_stages + rank``) holds layers ``bounds[p]:bounds[p + 1]``.
    """

    stage: int
    num_stages: int
    chunks: int
    bounds: tuple[int, ...]

    @property
    def parts(self) -> int:
        return self.num_stages * self.chunks

    def parts_of(self, rank: int) -> list[int]:
        return [c * self.num_stages + rank for c in range(self.chunks)]

    @property
    def local_parts(self) -> list[int]:
        return self.parts_of(self.stage)

    def layers_of(self, part: int) -> range:
        return range(self.bounds[part], self.bounds[part + 1])

    def rank_of_layer(self, index: int) -> int:
        for p in range(self.parts):
            if self.bounds[p] <= index < self.bounds[p + 1]:
                return p % self.num_stages
        raise IndexError(index)


class _LocalLayers(nn.ModuleDict):
    """The layers (or tied modules) one stage holds, keyed by position (or tie key).

    Loading a full state dict skips the keys of layers held by other stages instead of reporting them
    as unexpected (see [Note: state-dict names]); missing local keys are still reported.
    """

    def __init__(self, all_keys: Iterable[str]) -> None:
        super().__init__()
        self._all_keys = frozenset(all_keys)

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool, missing_keys: list[str],
        unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        others = [k for k in unexpected_keys[before:] if k[len(prefix):].split(".", 1)[0] in self._all_keys]
        for k in others:
            unexpected_keys.remove(k)


def _layer_name(layer: LayerLike) -> str:
    if isinstance(layer, LayerSpec):
        return layer.name
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class PipelineModule(nn.Module):
    """A sequence of layers plus a loss, splittable into pipeline stages.

    Args:
        layers: :class:`LayerSpec` / :class:`TiedLayerSpec` (built lazily), ``nn.Module`` instances
            (already built; kept only by the stage that holds them) or plain functions of one argument.
            Layer ``i + 1`` receives what layer ``i`` returns (a tensor or a tuple of tensors).
        loss_fn: ``loss_fn(outputs, labels) -> scalar tensor``, a mean over the batch (so that the mean
            over equal micro-batches is the batch's loss). Needed for ``pipe((inputs, labels))``.
        partition: how layers are split into stages: ``"parameters"`` (balanced parameter counts,
            default), ``"uniform"`` (layer counts), ``"type:<regex>"`` (balanced count of layers whose
            class name matches) or explicit boundaries such as ``[0, 3, 8]``.
        seed_layers: build layer ``i`` from seed ``base_seed + i`` (see [Note: lazy construction]).
        activation_checkpoint_interval: recompute activations in backward in segments of this many
            layers (0: store them), DeepSpeed's option of the same name.
    """

    def __init__(
        self,
        layers: Sequence[LayerLike],
        loss_fn: Optional[Callable[[Any, Any], Tensor]] = None,
        partition: split_math.PartitionMethod = "parameters",
        *,
        seed_layers: bool = True,
        activation_checkpoint_interval: int = 0,
    ) -> None:
        super().__init__()
        self._placement: Optional[Placement] = None
        self._runtime: Optional[Runtime] = None
        specs = tuple(layers)
        if not specs:
            raise ValueError("PipelineModule needs at least one layer.")
        for i, layer in enumerate(specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"layer {i} ({layer!r}) is not a LayerSpec, an nn.Module or a callable.")
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}.")
        if not isinstance(partition, str):
            partition = tuple(int(b) for b in partition)
        self._specs = specs
        self.loss_fn = loss_fn
        self.partition_method = partition
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.base_seed: Optional[int] = int(torch.randint(0, 2**31 - 1, ()).item()) if seed_layers else None
        self._tied_first = {}
        for i, s in enumerate(specs):
            if isinstance(s, TiedLayerSpec):
                self._tied_first.setdefault(s.key, i)
        self.layers = _LocalLayers(str(i) for i, s in enumerate(specs) if self._is_layer_module(s))
        self.tied = _LocalLayers(self._tied_first)

    # ------------------------------------------------------------------------------- introspection
    @staticmethod
    def _is_layer_module(spec: LayerLike) -> bool:
        return isinstance(spec, nn.Module) or (isinstance(spec, LayerSpec) and not isinstance(spec, TiedLayerSpec))

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def layer_specs(self) -> tuple[LayerLike, ...]:
        return self._specs

    @property
    def placement(self) -> Optional[Placement]:
        return self._placement

    @property
    def is_materialized(self) -> bool:
        return self._placement is not None

    def layer_names(self) -> list[str]:
        return [_layer_name(s) for s in self._specs]

    def layer_weights(self) -> list[int]:
        """Parameter count of every position (tied modules count at each of theirs), built on the meta
        device so that counting costs no memory."""
        cache: dict[str, int] = {}
        out = []
        for i, spec in enumerate(self._specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in cache:
                    cache[spec.key] = self._count_spec(spec)
                out.append(cache[spec.key])
            elif isinstance(spec, LayerSpec):
                out.append(self._count_spec(spec))
            elif isinstance(spec, nn.Module):
                out.append(_count(spec))
            else:
                out.append(0)
        return out

    @staticmethod
    def _count_spec(spec: LayerSpec) -> int:
        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    return _count(spec.build())
            except Exception:  # a constructor that cannot run on meta: count a real (discarded) copy
                return _count(spec.build())

    def split(self, parts: int) -> list[int]:
        """Boundaries of ``parts`` contiguous parts by this module's partition method (pure)."""
        return split_math.split(self.partition_method, self.num_layers, parts, self.layer_weights, self.layer_names)

    def tied_holders(self, placement: Optional[Placement] = None) -> dict[str, list[int]]:
        """For every tie key, the ranks holding one of its positions (every rank can compute this)."""
        pl = placement or self._placement
        assert pl is not None, "materialize() first"
        holders: dict[str, set[int]] = {}
        for i, spec in enumerate(self._specs):
            if isinstance(spec, TiedLayerSpec):
                holders.setdefault(spec.key, set()).add(pl.rank_of_layer(i))
        return {k: sorted(v) for k, v in holders.items()}

    # ------------------------------------------------------------------------------- construction
    @contextmanager
    def _seeded(self, index: int) -> Iterator[None]:
        if self.base_seed is None:
            yield
            return
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(self.base_seed + index)
            if cuda:
                torch.cuda.manual_seed(self.base_seed + index)
            yield

    def materialize(self, stage: int = 0, num_stages: int = 1, chunks: int = 1) -> None:
        """Build (or keep) the layers of ``stage`` out of ``num_stages`` x ``chunks`` parts; idempotent.

        A module built whole (one stage) may later be narrowed to a stage; any other re-placement is an
        error, because the layers of other stages are gone.
        """
        if not 0 <= stage < num_stages or chunks < 1:
            raise ValueError(f"invalid placement stage={stage}, num_stages={num_stages}, chunks={chunks}.")
        old = self._placement
        if old is not None:
            if (old.stage, old.num_stages, old.chunks) == (stage, num_stages, chunks):
                return
            if old.parts != 1:
                raise RuntimeError(
                    f"PipelineModule is already placed as stage {old.stage} of {old.num_stages} (x{old.chunks} "
                    f"chunks) and cannot be re-placed as stage {stage} of {num_stages}: build a new module."
                )
        bounds = tuple(self.split(num_stages * chunks))
        placement = Placement(stage, num_stages, chunks, bounds)
        local = {i for p in placement.local_parts for i in placement.layers_of(p)}
        tied_local = {s.key for i, s in enumerate(self._specs) if i in local and isinstance(s, TiedLayerSpec)}
        layers, tied = self._modules["layers"], self._modules["tied"]  # not via __getattr__ (it builds)
        assert isinstance(layers, _LocalLayers) and isinstance(tied, _LocalLayers)
        for key in [k for k in layers.keys() if int(k) not in local]:
            del layers[key]
        for key in [k for k in tied.keys() if k not in tied_local]:
            del tied[key]
        for i in sorted(local):
            spec = self._specs[i]
            if self._is_layer_module(spec) and str(i) not in layers:
                if isinstance(spec, nn.Module):
                    module = spec
                else:
                    with self._seeded(i):
                        module = spec.build()
                layers[str(i)] = module.train(self.training)
        for key in sorted(tied_local):
            if key not in tied:
                first = self._tied_first[key]
                spec = self._specs[first]
                assert isinstance(spec, TiedLayerSpec)
                with self._seeded(first):
                    tied[key] = spec.build().train(self.training)
        self._placement = placement

    def _ensure_built(self) -> None:
        if self._placement is None:
            self.materialize()

    # Funnel points through which nn.Module reaches submodules: build first (see [Note: lazy construction]).
    def __getattr__(self, name: str) -> Any:
        if name in ("layers", "tied") and self.__dict__.get("_placement", False) is None:
            self.materialize()
        return super().__getattr__(name)

    def named_modules(self, memo: Optional[set] = None, prefix: str = "", remove_duplicate: bool = True):  # type: ignore[override]
        self._ensure_built()
        return super().named_modules(memo, prefix, remove_duplicate)

    def named_children(self):  # type: ignore[override]
        self._ensure_built()
        return super().named_children()

    def _apply(self, fn: Callable, recurse: bool = True):  # type: ignore[override]
        self._ensure_built()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self._ensure_built()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._ensure_built()
        super()._load_from_state_dict(*args, **kwargs)

    # ------------------------------------------------------------------------------- running
    def attach_runtime(self, runtime: Optional[Runtime]) -> None:
        """Called by the strategy: from now on ``forward`` runs the pipeline schedule (None: in sequence)."""
        self._runtime = runtime

    @property
    def runtime(self) -> Optional[Runtime]:
        return self._runtime

    def tied_module(self, key: str) -> nn.Module:
        return self.tied[key]

    def _call_layer(self, index: int, x: Any) -> Any:
        spec = self._specs[index]
        if isinstance(spec, TiedLayerSpec):
            module = self.tied[spec.key]
            return spec.forward_fn(module, x) if spec.forward_fn is not None else module(x)
        if self._is_layer_module(spec):
            return self.layers[str(index)](x)
        return spec(x)

    def _run_range(self, indices: range, x: Any) -> Any:
        for i in indices:
            x = self._call_layer(i, x)
        return x

    def run_layers(self, indices: range, x: Any) -> Any:
        """Run layers ``indices`` on ``x``, recomputing activations in segments when asked."""
        step = self.activation_checkpoint_interval
        if step <= 0 or not torch.is_grad_enabled():
            return self._run_range(indices, x)
        for start in range(indices.start, indices.stop, step):
            segment = range(start, min(start + step, indices.stop))
            x = checkpoint(self._run_range, segment, x, use_reentrant=False,
                           **replay_buffers(*self._modules_of(segment)))
        return x

    def _modules_of(self, indices: range) -> list[nn.Module]:
        """The modules layers ``indices`` run (a recomputed segment replays their buffers:
        activations/recompute.py [Note: buffers in a recomputed region])."""
        out = []
        for i in indices:
            spec = self._specs[i]
            if isinstance(spec, TiedLayerSpec):
                out.append(self.tied[spec.key])
            elif self._is_layer_module(spec):
                out.append(self.layers[str(i)])
            elif isinstance(spec, nn.Module):
                out.append(spec)
        return out

    def run_part(self, part: int, x: Any) -> Any:
        """Forward through virtual stage ``part`` (this rank must hold it)."""
        assert self._placement is not None
        return self.run_layers(self._placement.layers_of(part), x)

    def compute_loss(self, outputs: Any, labels: Any) -> Tensor:
        if self.loss_fn is None:
            raise ValueError(
                "PipelineModule(loss_fn=None) cannot return a loss: pass loss_fn, or call pipe.predict(inputs)."
            )
        loss = self.loss_fn(outputs, labels)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}.")
        return loss.reshape(())

    def forward(self, batch: Any) -> Tensor:
        """``batch = (inputs, labels)`` -> the loss (under a pipeline: averaged over micro-batches, with the
        backward already done inside when training; see ``runtime.PipelineRuntime.run``)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                "PipelineModule expects batch=(inputs, labels) and returns the loss; for outputs without a "
                f"loss call pipe.predict(inputs). Got {type(batch).__name__}"
                + (f" of length {len(batch)}." if isinstance(batch, (tuple, list)) else ".")
            )
        inputs, labels = batch
        if self._runtime is not None:
            return self._runtime.run(inputs, labels)
        self._ensure_built()
        return self.compute_loss(self.run_layers(range(self.num_layers), inputs), labels)

    def predict(self, inputs: Any) -> Any:
        """The last layer's outputs (under a pipeline: computed by the last stage, returned on every rank)."""
        if self._runtime is not None:
            return self._runtime.predict(inputs)
        self._ensure_built()
        return self.run_layers(range(self.num_layers), inputs)

    def extra_repr(self) -> str:
        pl = self._placement
        where = "unplaced" if pl is None else f"stage {pl.stage}/{pl.num_stages}, chunks {pl.chunks}, bounds {list(pl.bounds)}"
        return f"num_layers={self.num_layers}, partition={self.partition_method!r}, {where}"


def find_pipeline_modules(root: nn.Module) -> list[tuple[str, PipelineModule]]:
    """PipelineModules inside ``root``, found without building them (walks ``_modules`` directly)."""
    found: list[tuple[str, PipelineModule]] = []
    stack: list[tuple[str, nn.Module]] = [("", root)]
    seen: set[int] = set()
    while stack:
        name, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        if isinstance(mod, PipelineModule):
            found.append((name, mod))
            continue
        for child_name, child in mod._modules.items():
            if child is not None:
                stack.append((f"{name}.{child_name}" if name else child_name, child))
    return sorted(found, key=lambda t: t[0])


__all__ = ["PipelineModule", "Placement", "LayerLike", "find_pipeline_modules"]
