"""ZeroFabricStrategy: Lightning Fabric's front door to the ZeRO engines. No ZeRO math lives here.

Reading order of a Fabric loop: ``setup_environment`` (process groups, environment.py) ->
``module_init_context`` (stage 3 with ``empty_init=True``: parameters on the meta device) ->
``setup_module_and_optimizers`` (module placed and made identical on every rank, one engine per
optimizer, stage 3 materialising unit by unit, the module cast to the compute dtype) -> per batch:
the module's forward (a pre-forward hook opens the step: buffers from rank 0, stage-3 root unit
gathered, ReadWatch on the first batch of each kind) -> ``backward`` (loss scaled, engines reduce)
-> ``clip_gradients_norm`` (the global norm, recorded for the step) -> ``optimizer_step``
(``engine.step``) -> ``save_checkpoint``/``load_checkpoint`` (fabric/checkpoint.py).

[Note: set up without an optimizer]
``fabric.setup_module(model)`` may come before the optimizer exists (FSDP's order). Below stage 3
the module is usable alone (inference) and the engines are built by ``setup_optimizers``; the cast to
16 bits waits for them (the masters are taken in fp32) or for the first forward. Stage 3 partitions
parameters together with their optimizer: a stage-3 module whose optimizer was never set up fails
at its first forward, before any collective, naming the fix.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.init import _EmptyInit
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import environment as E
from lightning_zero.apply import build_engines, finish_setup, keep_frozen_fp32, place, prepare_module
from lightning_zero.checkpoint.sharded import ShardedCheckpointer
from lightning_zero.checkpoint.strategy_io import StrategyCheckpoints
from lightning_zero.comm import collectives as C
from lightning_zero.config import LossScaleConfig, ZeroConfig
from lightning_zero.config.presets import register_presets
from lightning_zero.engines import Engines
from lightning_zero.fabric.checkpoint import FabricCheckpoints
from lightning_zero.fabric.precision import ZeroFabricPrecision
from lightning_zero.inference.engine import build_inference_engine
from lightning_zero.offload.settings import OffloadHost
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.precision import ZeroPrecision
from lightning_zero.zero.compile import CompilePlan
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.grad_window import FABRIC_FIXES, partitioned_grads
from lightning_zero.zero.materialize import params_on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PIPELINE_REFUSAL = (
    "lightning_zero's pipeline parallelism (pipeline_stages > 1) runs through the Trainer only: its schedule "
    "drives forward and backward of every micro-batch inside training_step, which a Fabric loop writes itself. "
    "Use Trainer(strategy='pipeline'), or a ZeRO stage (zero0..zero3, *_offload) under Fabric."
)


class ZeroFabricStrategy(ParallelStrategy, _Sharded):
    """DeepSpeed's ZeRO for Lightning Fabric: ``Fabric(strategy="zero3")`` or
    ``Fabric(strategy=ZeroFabricStrategy(stage=3, offload_optimizer="cpu"))``.

    Options are the fields of :class:`lightning_zero.config.ZeroConfig`, exactly as for the Trainer's
    :class:`~lightning_zero.ZeroStrategy` (an unknown one is an error naming the valid ones).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = ZeroConfig.stage,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        loss_scale: Optional[Union[LossScaleConfig, dict]] = None,
        **options: Any,
    ) -> None:
        self.config = ZeroConfig.from_kwargs(stage=stage, **options)
        self._loss_scale = loss_scale  # read by the precision setter that Fabric's __init__ calls
        if self.config.pipeline_stages > 1:
            raise NotImplementedError(PIPELINE_REFUSAL)
        if self.config.sequence_parallel > 1:
            raise NotImplementedError(f"sequence_parallel={self.config.sequence_parallel} under Fabric is not built yet: "
                                      "use the Trainer's ZeroStrategy")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._num_nodes = 1
        self._zero = Engines(self.config, lambda: self.precision)
        self._checkpoints = StrategyCheckpoints(self._zero, self)
        self._fabric_checkpoints = FabricCheckpoints(self._checkpoints, self._convert_stateful_objects_in_state)
        self._backward_sync_control = _ZeroBackwardSyncControl(self._zero)
        self._module: Optional[Module] = None
        self._optimizers: list[Optimizer] = []
        self._hooks: list[Any] = []
        self._ready = False
        """Whether the module is cast and its engines (if any) exist ([Note: set up without an optimizer])."""
        self._clip: dict[int, float] = {}
        self._clip_value: dict[int, float] = {}  # precision.py [Note: clipping by value]
        self._grad_window: Optional[AbstractContextManager[None]] = None  # _open_grad_window
        self._placeholders: dict[int, Any] = {}  # zero/grad_window.py, reused from step to step
        """Per engine: the max_norm of ``clip_gradients`` for its next step."""
        self._backward_pending = False
        """A training forward ran and its backward has not: a second forward belongs to the same step."""

    # ------------------------------------------------------------------ Fabric plumbing
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is sharded by data-parallel rank only."""
        return E.sampler_kwargs(self.dims, self.num_nodes * self.num_processes, self.global_rank)

    def _set_world_ranks(self) -> None:
        """Fabric's connector calls it under this name too, so ``fabric.global_rank`` is right before launch."""
        E.set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes, self._num_nodes)

    @property
    def dims(self) -> Optional[ParallelDims]:
        """This job's process groups (parallel_dims.py); None before ``setup_environment``."""
        return self._zero.dims

    @property
    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The ``("pp", "dp", "tp")`` DeviceMesh of this job (parallel_dims.py [Note: one mesh])."""
        return self.dims.mesh if self.dims is not None else None

    @property
    def expert_parallel_group(self) -> Optional[C.ProcessGroup]:
        """This rank's expert-parallel group (``expert_parallel`` > 1), None before ``setup_environment``."""
        return self.dims.ep_group if self.dims is not None else None

    @property
    def engines(self) -> list[ZeroEngine]:
        return self._zero.engines

    @property
    def grad_norm(self) -> Optional[float]:
        """Global gradient norm (unscaled, before clipping) of the last step, for logging."""
        return self._zero.grad_norm

    @property
    def loss_scale(self) -> Optional[float]:
        return self._zero.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank so far: fp16 overflows and non-finite steps (``nonfinite='skip'``)."""
        return self._zero.skipped_steps

    @property
    def compile_plan(self) -> Optional[CompilePlan]:
        return self._zero.compile_plan

    def gathered_params(self, module: Optional[Module] = None, writeback: bool = False) -> AbstractContextManager[None]:
        """Full parameters of ``module`` (default: all) inside the block; collective under stage 3."""
        return self._zero.gathered_params(module, writeback)

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers set up through this strategy, in order."""
        return list(self._optimizers)

    @property  # type: ignore[override]  # lightning types the base property's setter as taking Optional[Precision] only
    def precision(self) -> ZeroFabricPrecision:
        plugin = self._precision
        return plugin if isinstance(plugin, ZeroFabricPrecision) else ZeroFabricPrecision("32-true", self._loss_scale)

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        """Fabric's connector hands us a plugin built from ``precision=...``: convert it."""
        if plugin is None or isinstance(plugin, ZeroFabricPrecision):
            self._precision = plugin.use_autocast(self.config.autocast) if plugin is not None else None
            return
        if isinstance(plugin, ZeroPrecision):  # the Trainer's plugin: same settings, Fabric's calls
            zp = ZeroFabricPrecision(plugin.precision)
            zp.scaler = plugin.scaler
        else:
            zp = ZeroFabricPrecision.from_plugin(plugin)
            if self._loss_scale is not None and zp.scaler is not None:
                zp = ZeroFabricPrecision(zp.precision, self._loss_scale)
        self._precision = zp.use_autocast(self.config.autocast)  # precision.py [Note: two mixed-precision layouts]

    @property
    def precision_plugin(self) -> ZeroFabricPrecision:
        """The Trainer strategies' name for the precision plugin (kept: code written for both reads it)."""
        return self.precision

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.config.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.config.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        self._zero.dims = E.init_process_groups(self.config, self.cluster_environment, self.world_size, self.global_rank,
                                                self.root_device)
        self._checkpoints.setup_checkpointer()
        self.precision.device_type = self.root_device.type  # autocast's device (mixed_precision='autocast')
        self._zero.failed = False
        C.destroy_groups_at_exit(True)  # comm/collectives.py [Note: destroy at exit]; Fabric calls no teardown
        # No peer watchdog: Fabric calls no teardown or exception hook that would stop its thread.

    @override
    def module_to_device(self, module: Module) -> None:
        place(module, self.root_device)  # meta parameters stay: materialised unit by unit

    # ------------------------------------------------------------------ building the model
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """On this rank's device; stage 3 with ``empty_init=True``: parameters on the meta device,
        materialised unit by unit by the engine (materialize.py), each costing memory once."""
        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        if self.config.stage == 3 and empty_init:
            stack.enter_context(params_on_meta())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return params_on_meta() if self.config.stage == 3 else nullcontext()

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Module, list[Optimizer], Optional[Any]]:
        self._adopt(module)
        self._add_optimizers(optimizers)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        """[Note: set up without an optimizer]: the engines come with ``setup_optimizers``."""
        self._adopt(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise RuntimeError("Set the model up first: `model = fabric.setup_module(model)`, then the optimizer.")
        self._add_optimizers([optimizer])
        return optimizer

    def _adopt(self, module: Module) -> None:
        if self._module is not None and module is not self._module:
            raise ValueError(
                "ZeroFabricStrategy sets up one model: its engines partition that model's parameters. Put several "
                "networks (a GAN's generator and discriminator) in one nn.Module and give each its own optimizer."
            )
        if self._module is None:
            assert self.dims is not None
            self._zero.unshard_to_plain()
            prepare_module(self._zero, module, self.dims, self.root_device)
            self._module = module
            self._hooks = [
                module.register_forward_pre_hook(self._pre_forward, prepend=True),
                module.register_forward_hook(self._post_forward),
            ]

    def _add_optimizers(self, optimizers: list[Optimizer]) -> None:
        assert self._module is not None
        if not optimizers:
            return
        if self._ready and self.config.stage == 3:
            raise RuntimeError(
                "ZeRO stage 3 partitions the model together with all its optimizers: set them up in one call, "
                "`fabric.setup(model, opt1, opt2)` or `fabric.setup_optimizers(opt1, opt2)` right after setup_module."
            )
        if self._ready and len(self._zero) and any(p.dtype != torch.float32 for p in self._module.parameters()):
            raise RuntimeError("Set every optimizer up before the first forward: the module is cast to 16 bits by then.")
        new = [getattr(o, "optimizer", o) for o in optimizers]
        assert self.dims is not None
        if not self._ready:  # the module is not cast yet (apply.py step 4a)
            keep_frozen_fp32(self._zero, self._module, [*self._optimizers, *new], self.dims, self.precision,
                             self.num_processes)
        build_engines(self._zero, self._module, [*self._optimizers, *new], dims=self.dims, device=self.root_device,
                      precision=self.precision, host=OffloadHost(self.num_processes, self.global_rank, True), only=new)
        self._optimizers += new
        for opt in new:
            engine = self._zero.of(opt)
            assert engine is not None
            _route_zero_grad(opt, engine)
        self._finish()
        self._checkpoints.reserve_async_staging()

    def _finish(self) -> None:
        if not self._ready:
            assert self._module is not None
            finish_setup(self._zero, self._module, self.root_device, self.precision)
            self._ready = True

    # ------------------------------------------------------------------ one step
    def _pre_forward(self, module: Module, args: Any) -> None:
        """Opens a step (the Trainer's ``training_step``/``validation_step`` do it there)."""
        if not self._ready:
            # stage 3 without an optimizer: an evaluation-only model (inference/engine.py) when its first
            # forward runs without autograd; with autograd the optimizer was most likely forgotten
            if self.config.stage == 3 and (torch.is_grad_enabled() or not self._build_inference_engine()):
                raise RuntimeError(
                    "ZeRO stage 3 partitions the model's parameters together with their optimizer, but this model was "
                    "set up without one. Call `optimizer = fabric.setup_optimizers(optimizer)` after "
                    "`fabric.setup_module(model)`, or `model, optimizer = fabric.setup(model, optimizer)`, before the "
                    "first forward (for inference without an optimizer run the forwards under torch.no_grad())."
                )
            self._finish()
        if self._backward_pending:
            return  # a second forward of the same step (its root unit is gathered already)
        kind = "train" if torch.is_grad_enabled() else "val"
        self._zero.watch_first(kind)
        self._zero.start_step(kind)
        self._zero.set_gathering(True)

    def _build_inference_engine(self) -> bool:
        """ZeRO-Inference for a module set up without optimizers (False where it does not apply)."""
        assert self._module is not None
        return build_inference_engine(self._zero, self._module, device=self.root_device,
                                      compute_dtype=self.precision.compute_dtype, global_rank=self.global_rank)

    def _post_forward(self, module: Module, args: Any, output: Any) -> None:
        self._zero.set_gathering(False)
        if torch.is_grad_enabled():
            self._backward_pending = True
        else:
            self._zero.end_eval_step()

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """The loss scaled (fp16), backward (engine hooks reduce buckets), the reductions finished."""
        self._close_grad_window()  # autograd accumulates into .grad
        for engine in self._zero:
            self._zero.before_backward(engine)
        scaler = self.precision.scaler
        if scaler is not None:
            tensor = tensor * scaler.scale
        tensor.backward(*args, **kwargs)
        self._zero.post_backward()
        self._backward_pending = False
        self._open_grad_window()

    def _open_grad_window(self) -> None:
        """Placeholder gradients from ``fabric.backward`` to ``optimizer.step()`` (or the next backward):
        a torch clip or a ``p.grad`` edit in the loop is refused (zero/grad_window.py [Note: gradients in
        the hooks before the step])."""
        engines = [e for e in self._zero if e.stage >= 1]
        params = [p for e in engines for fg in e.groups for p in fg.params if local_tensor(p) is p]
        if self._grad_window is None and params:
            names = {k: v for e in engines for k, v in e.param_names.items()}
            self._grad_window = partitioned_grads(params, names, FABRIC_FIXES, cache=self._placeholders)
            self._grad_window.__enter__()

    def _close_grad_window(self) -> None:
        window, self._grad_window = self._grad_window, None
        if window is not None:
            window.__exit__(None, None, None)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global 2-norm over every partition (before clipping, unscaled), returned now; the clip
        itself is one multiply inside the next ``optimizer.step()`` (the engine unscales there too)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"ZeRO clips by the global 2-norm only (norm_type=2.0), got norm_type={norm_type!r}.")
        engine = self._engine_or_raise(optimizer)
        if id(engine) in self._clip_value:
            raise ValueError("clip_gradients by norm after clipping by value in the same step is not supported under ZeRO.")
        scaler = self.precision.scaler
        scale = scaler.scale if scaler is not None else 1.0
        norm = engine.global_grad_norm_sq(engine._master_grads()).sqrt() / scale
        # under nonfinite='skip' the next optimizer.step() skips such a step (zero/engine.py [Note: non-finite steps])
        if error_if_nonfinite and scaler is None and self.config.nonfinite != "skip" and not math.isfinite(float(norm)):
            raise RuntimeError(
                f"The total norm of the gradients is non-finite ({float(norm)}), so it cannot be clipped. "
                "Set error_if_nonfinite=False to step anyway, or ZeroFabricStrategy(nonfinite='skip') to skip the step."
            )
        self._clip[id(engine)] = float(max_norm)
        return norm

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        """Each element of the unscaled gradient clamped to [-clip_val, clip_val], inside the next
        ``optimizer.step()`` on each rank's reduced shard (precision.py [Note: clipping by value])."""
        engine = self._engine_or_raise(optimizer)
        if id(engine) in self._clip:
            raise ValueError("clip_gradients by value after clipping by norm in the same step is not supported under ZeRO.")
        self._clip_value[id(engine)] = float(clip_val)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        engine = self._engine_or_raise(optimizer)
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(f"optimizer.step() under ZeRO takes only a closure, got {sorted(kwargs)}.")
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._close_grad_window()
        self._zero.step(engine, self._clip.pop(id(engine), None), clip_value=self._clip_value.pop(id(engine), None))
        return result

    def _engine_or_raise(self, optimizer: Any) -> ZeroEngine:
        engine = self._zero.of(getattr(optimizer, "optimizer", optimizer))
        if engine is None:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not set up by this strategy: pass it to `fabric.setup(model, optimizer)` "
                "or `fabric.setup_optimizers(optimizer)`."
            )
        return engine

    # ------------------------------------------------------------------ collectives (environment.py)
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        E.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return E.broadcast(obj, src)

    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        return E.reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return E.all_gather(tensor, group)

    # ------------------------------------------------------------------ checkpoints (fabric/checkpoint.py)
    @property
    def checkpointer(self) -> ShardedCheckpointer:
        return self._checkpoints.checkpointer

    def full_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights by name (gathered onto every rank: collective)."""
        return self._checkpoints.full_state_dict()

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint save has finished (raises its error, if any)."""
        self._checkpoints.wait_for_checkpoint()

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return self._fabric_checkpoints.get_module_state_dict(module)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._fabric_checkpoints.get_optimizer_state(optimizer)

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        self._fabric_checkpoints.save_checkpoint(path, state, storage_options, filter)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self._fabric_checkpoints.load_checkpoint(path, state, strict, weights_only)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        self._fabric_checkpoints.load_module_state_dict(module, state_dict, strict)

    # ------------------------------------------------------------------ teardown / registry
    @override
    def teardown(self) -> None:
        """Engines finished (offload threads, swap files); parameters are not moved to the CPU (the
        engines keep their partitions, a save afterwards still works)."""
        self._close_grad_window()
        self._placeholders.clear()
        self._zero.teardown(self._checkpoints.wait_for_checkpoint)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(strategy_registry, ZeroFabricStrategy)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients accumulate locally (stages 0-1) while it is on."""

    def __init__(self, engines: Engines) -> None:
        self._engines = engines

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._engines.sync_blocked() if enabled else nullcontext()


def _route_zero_grad(optimizer: Optimizer, engine: ZeroEngine) -> None:
    """``optimizer.zero_grad()`` discards what the engine accumulated (engine.py [Note: the optimizer
    keeps the model's parameters]). Fabric's wrapper builds its class from the optimizer's class and
    finds ``zero_grad`` there, never on the instance (the Trainer's way), so the optimizer gets a
    subclass of its own class, named the same, whose ``zero_grad`` is the engine's."""
    base = type(optimizer)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        engine.zero_grad(set_to_none)

    optimizer.__class__ = type(base.__name__, (base,), {"zero_grad": zero_grad, "__module__": base.__module__})

