"""ZeroStrategy: the Trainer's front door to the ZeRO engines. No ZeRO math lives here.

Reading order of one fit: ``setup_environment`` (process groups, via :class:`ParallelDims`) ->
``setup`` (model to device, replicas made identical, ``configure_optimizers``, one engine per
optimizer, the rest of the module cast to the compute dtype) -> per batch: ``backward`` (engine hooks
reduce buckets) -> ``post_backward`` (engines finish reducing) -> ``optimizer_step`` (closure,
Lightning's hooks and clipping request, ``engine.step``) -> checkpoints through
``checkpoint/strategy_io.py`` -> ``teardown``.

[Note: one engine, two front doors]
``ZeroStrategy`` (this file, the Trainer's strategy class tree) and ``ZeroFabricStrategy``
(fabric/strategy.py, Fabric's tree) derive from different Lightning base classes. What they share is
held, not inherited: the distributed environment (environment.py), the setup sequence (apply.py's
``apply_zero``), the engines and their per-step events (engines.py's ``Engines``) and the checkpoints
(checkpoint/strategy_io.py's ``StrategyCheckpoints``). Each front door keeps only what its framework
calls and in what order; neither holds ZeRO math (zero/, offload/).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Generator, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_zero import environment as E
from lightning_zero.after_fit import needs_restore, restore_module
from lightning_zero.apply import ENGINES, apply_zero, place
from lightning_zero.checkpoint.sharded import ShardedCheckpointer
from lightning_zero.checkpoint.strategy_io import StrategyCheckpoints
from lightning_zero.comm import collectives as C
from lightning_zero.config import LossScaleConfig, SequenceConfig, ZeroConfig
from lightning_zero.config.presets import register_presets
from lightning_zero.engines import Engines
from lightning_zero.layer_sync import apply_layer_sync
from lightning_zero.offload.settings import OffloadHost
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.pipeline.integration import PipelineIntegration
from lightning_zero.precision import ZeroPrecision
from lightning_zero.sequence import apply as sequence_apply
from lightning_zero.sequence.context import SequenceContext
from lightning_zero.trainer_checks import RefusesCompiledWhole, check_callbacks
from lightning_zero.uneven import check_eval_lengths, check_training_epoch, gather_lengths
from lightning_zero.zero.compile import CompilePlan
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.grad_window import partitioned_grads
from lightning_zero.zero.materialize import has_meta_tensors, params_on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "ZeroStrategy"]


class ZeroStrategy(RefusesCompiledWhole, ParallelStrategy):
    """DeepSpeed's ZeRO for Lightning, on torch.distributed. ``Trainer(strategy=ZeroStrategy(stage=2))``.

    Options are the fields of :class:`lightning_zero.config.ZeroConfig` (an unknown one is an error
    naming the valid ones). ``loss_scale`` tunes fp16 dynamic loss scaling (:class:`LossScaleConfig`).
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
        precision_plugin: Optional[Precision] = None,
        loss_scale: Optional[Union[LossScaleConfig, dict]] = None,
        **options: Any,
    ) -> None:
        self.config = ZeroConfig.from_kwargs(stage=stage, **options)
        self._loss_scale = loss_scale  # read by the precision setter that Lightning's __init__ calls
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._zero = Engines(self.config, lambda: self.precision_plugin)
        self._checkpoints = StrategyCheckpoints(self._zero, self)
        self._manual_window: Optional[AbstractContextManager[None]] = None  # _open_manual_window
        self._placeholders: dict[int, Any] = {}  # zero/grad_window.py, reused from step to step
        self._pipeline: Optional[PipelineIntegration] = None
        self._sequence: Optional[SequenceContext] = None
        self._layer_synced = False  # layer_sync.py: applied in this fit's setup, reverted at teardown

    # ------------------------------------------------------------------ Lightning plumbing
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
        """Data is sharded by data-parallel rank only: the stages of one pipeline see the same batch."""
        return E.sampler_kwargs(self.dims, self.num_nodes * self.num_processes, self.global_rank)

    def _set_world_ranks(self) -> None:
        E.set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes, self._num_nodes)

    @property
    def dims(self) -> Optional[ParallelDims]:
        """This job's process groups (parallel_dims.py); None before ``setup_environment``."""
        return self._zero.dims

    @property
    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The ``("pp", "dp", "tp")`` DeviceMesh of this job (parallel_dims.py [Note: one mesh]), as
        Lightning's ``ModelParallelStrategy`` exposes its own; ``configure_model`` applies tensor
        parallelism with ``self.device_mesh["tp"]``. None before ``setup_environment``."""
        return self.dims.mesh if self.dims is not None else None

    @property
    def expert_parallel_group(self) -> Optional[C.ProcessGroup]:
        """This rank's expert-parallel group (``expert_parallel`` > 1; parallel_dims.py [Note:
        expert-parallel groups]), for ``MoE(..., ep_group=...)`` built in ``configure_model``. None
        before ``setup_environment`` and without expert parallelism."""
        return self.dims.ep_group if self.dims is not None else None

    # ------------------------------------------------------------------ what the engines report
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
        """What zero/compile.py compiled or made eager at the last setup (None: nothing to do)."""
        return self._zero.compile_plan

    def gathered_params(self, module: Optional[torch.nn.Module] = None, writeback: bool = False) -> AbstractContextManager[None]:
        """Full parameters of ``module`` (default: all) inside the block, e.g. for generation or export.
        Below stage 3 the parameters are full already; ``writeback`` puts changes made inside into the
        masters. Under stage 3 it is collective: every rank must enter it."""
        return self._zero.gathered_params(module, writeback)

    def _engine_of(self, optimizer: Any) -> Optional[ZeroEngine]:
        return self._zero.of(optimizer)

    @property
    def is_distributed(self) -> bool:
        """Lightning's connector special-cases its own strategies by isinstance; custom ones must say
        this, or the Trainer adds no DistributedSampler and every rank trains on the same data."""
        return True

    @property  # type: ignore[override]  # lightning types the base property's setter as taking Optional[Precision] only
    def precision_plugin(self) -> ZeroPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, ZeroPrecision) else ZeroPrecision("32-true", self._loss_scale)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning's connector hands us a generic plugin built from ``precision=...``: convert it."""
        if plugin is None:
            self._precision_plugin = None
            return
        zp = ZeroPrecision.from_plugin(plugin)
        if zp is not plugin and self._loss_scale is not None and zp.scaler is not None:
            zp = ZeroPrecision(zp.precision, self._loss_scale)
        self._precision_plugin = zp.use_autocast(self.config.autocast)  # precision.py [Note: two mixed-precision ...]

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
        C.destroy_groups_at_exit(True)  # comm/collectives.py [Note: destroy at exit]
        self._zero.start_watchdog()  # failures.py [Note: failing once]
        assert self.dims is not None
        if self.lightning_module is not None:  # configure_model reads self.device_mesh, as under ModelParallelStrategy
            self.lightning_module._device_mesh = self.device_mesh
        self._pipeline = PipelineIntegration(self.config, self.dims, self.root_device) if self.dims.pp > 1 else None
        self._checkpoints.pipeline = self._pipeline
        if self._pipeline is not None:  # build only this stage's layers, before Lightning's hooks touch them
            self._pipeline.place(self.lightning_module)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None and self.dims is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type  # autocast's device (mixed_precision='autocast')
        if self._pipeline is not None:  # this stage's layers only, tied copies made equal
            self._pipeline.prepare(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # before any step ([Note: callbacks that edit parameters or param groups mid-training])
            check_callbacks(trainer.callbacks)
        if fitting and self._layer_sync is not None:  # layer_sync.py [Note: synchronised batch norm]
            self.model = apply_layer_sync(self._layer_sync, self.model, self.dims.dp_group, self.root_device,
                                          C.is_initialized())
            self._layer_synced = True

        def optimizers() -> list[Optimizer]:
            self.setup_optimizers(trainer)  # Lightning's configure_optimizers, on the placed module
            return self.optimizers

        if self.config.sequence_parallel > 1 and self._sequence is None:  # sequence/apply.py, before the engines
            self._sequence = sequence_apply.prepare_module(self.lightning_module, self.config.piece(SequenceConfig),
                                                           self.dims)
        apply_zero(self.model, optimizers if fitting else None, self._zero, dims=self.dims, device=self.root_device,
                   precision=self.precision_plugin,
                   host=OffloadHost(self.num_processes, self.global_rank, trainer.accumulate_grad_batches > 1))
        if fitting:
            if self._pipeline is None:  # pipeline stages run backward inside training_step, before Lightning's
                # zero_grad (which comes between training_step and backward): it must not discard their gradients
                self._zero.route_zero_grad([*self.optimizers, *self._lightning_optimizers])
            self._checkpoints.reserve_async_staging()
        self._lengths_checked_epoch: Optional[int] = None  # uneven.py [Note: uneven inputs], once per epoch
        if self._pipeline is not None:  # from now on pipe((inputs, labels)) runs the schedule
            self._pipeline.attach(trainer, self.engines, lambda: self.precision_plugin.loss_scale)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` builds parameters on the meta device (materialize.py); weights
        the module built or loaded before keep their values ([Note: the user's weights are kept])."""
        if self.config.stage != 3:
            yield
            return
        with params_on_meta(self.lightning_module):
            yield

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """A new batch: the first of each kind (train, val, test, predict) runs under ReadWatch, from
        here to the next batch (read_watch.py)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        kind = _loop_kind(trainer)
        self._zero.watch_first(kind)
        if self._sequence is not None:  # this rank's slice of every sequence, split on the host before it moves
            # ([Note: sequence parallelism in the strategy])
            if kind == "predict":
                raise ValueError(f"sequence_parallel={self.config.sequence_parallel}: predict is not built yet "
                                 "(each rank would return a slice of the outputs)")
            assert self.dims is not None
            batch = sequence_apply.split_batch(batch, self._sequence, self.dims, self.config.piece(SequenceConfig))
            sequence_apply.move_documents(self._sequence, device or self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._zero.begin_step("train"):
                out = super().training_step(*args, **kwargs)
        finally:
            self._close_manual_window()
        if self._sequence is not None and self._sequence.calls == 0:  # the first step ran no split attention
            sequence_apply.check_attention_ran(self._sequence, self.lightning_module)
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._zero.begin_step("val"):
                return super().validation_step(*args, **kwargs)
        finally:
            self._zero.end_eval_step()

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._zero.begin_step("test"):
                return super().test_step(*args, **kwargs)
        finally:
            self._zero.end_eval_step()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._zero.begin_step("predict"):
                return super().predict_step(*args, **kwargs)
        finally:
            self._zero.end_eval_step()

    # ------------------------------------------------------------------ uneven inputs (uneven.py)
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first batch of each epoch: the ranks compare their loaders' lengths (one small all-gather)
        and stop together, in one line, if the epoch would part them ([Note: uneven inputs])."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self.world_size == 1 or getattr(self, "_lengths_checked_epoch", None) == trainer.current_epoch:
            return
        self._lengths_checked_epoch = trainer.current_epoch
        lengths = gather_lengths(trainer.num_training_batches)
        check_training_epoch(lengths, trainer.current_epoch, batch_idx, trainer.global_step, trainer.max_steps,
                             trainer.accumulate_grad_batches)

    def _check_eval_lengths(self, kind: str) -> None:
        """Stage 3 and pipelines run collectives in every evaluation forward: equal loop lengths or a refusal."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self.world_size == 1 or (self.config.stage < 3 and self._pipeline is None):
            return
        counts = {"val": trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches,
                  "test": trainer.num_test_batches, "predict": trainer.num_predict_batches}[kind]
        check_eval_lengths({"val": "validation"}.get(kind, kind), list(counts))

    @override
    def on_validation_start(self) -> None:
        self._check_eval_lengths("val")

    @override
    def on_test_start(self) -> None:
        self._check_eval_lengths("test")

    @override
    def on_predict_start(self) -> None:
        self._check_eval_lengths("predict")

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close_manual_window()
        # engines.py: reported once, no collectives from here on; an async save gets a bounded wait first
        self._zero.fail(exception, lambda: self._checkpoints.wait_or_abandon(timeout_s=60.0))

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        place(self.model, self.root_device)  # meta: materialised later, unit by unit

    # ------------------------------------------------------------------ training step plumbing
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: stages 0/1 keep accumulating locally; stage 2 reduces anyway."""
        with self._zero.sync_blocked():
            yield None

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._close_manual_window()  # autograd accumulates into .grad

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self._zero.post_backward()
        self._open_manual_window()

    def _open_manual_window(self) -> None:
        """Manual optimization: placeholder gradients from ``manual_backward`` to ``opt.step()`` (or the next
        backward, or the end of the training step): user code clipping ``p.grad`` there is refused
        (zero/grad_window.py [Note: gradients in the hooks before the step])."""
        model = self.lightning_module
        if model is None or model.automatic_optimization or self._manual_window is not None or self._pipeline is not None:
            return
        engines = [e for e in self.engines if e.stage >= 1]
        params = [p for e in engines for fg in e.groups for p in fg.params if local_tensor(p) is p]
        if params:
            names = {k: v for e in engines for k, v in e.param_names.items()}
            self._manual_window = partitioned_grads(params, names, cache=self._placeholders)
            self._manual_window.__enter__()

    def _close_manual_window(self) -> None:
        window, self._manual_window = self._manual_window, None
        if window is not None:
            window.__exit__(None, None, None)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        engine = self._zero.of(optimizer)
        if engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        self._zero.before_backward(engine)
        engine.step_in_backward = self._step_can_run_in_backward(model)  # offload/eager.py; other engines ignore it
        result = closure()
        precision = self.precision_plugin
        with self._grads_in_hooks(model, engine):  # zero/grad_window.py
            precision._after_closure(model, optimizer)
        self._close_manual_window()
        clip, clip_value = precision.pop_clip()
        if result is None and model.automatic_optimization:
            engine._zero_grads()  # training_step returned None: skip the step, as torch would
            return None
        self._zero.step(engine, clip, self._step_index(), clip_value=clip_value)
        return result

    def _grads_in_hooks(self, model: "pl.LightningModule", engine: ZeroEngine) -> AbstractContextManager[None]:
        """Stages 1-3 with a hook before the step: placeholder gradients that refuse arithmetic
        ([Note: gradients in the hooks before the step])."""
        callbacks = model.trainer.callbacks if model._trainer is not None else []
        hooked = (is_overridden("on_before_optimizer_step", model, pl.LightningModule)
                  or is_overridden("configure_gradient_clipping", model, pl.LightningModule)
                  or any(is_overridden("on_before_optimizer_step", cb, pl.Callback) for cb in callbacks))
        if engine.stage < 1 or not hooked or self._manual_window is not None:
            return nullcontext()
        params = [p for fg in engine.groups for p in fg.params if local_tensor(p) is p]
        return partitioned_grads(params, engine.param_names, cache=self._placeholders)

    def _step_index(self) -> Optional[int]:
        """The Trainer's ``global_step`` (restored on resume) when one optimizer steps per batch (for
        messages); None: the engine's own count."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and len(self._zero) == 1:
            return int(trainer.global_step)
        return None

    def _step_can_run_in_backward(self, model: "pl.LightningModule") -> bool:
        """Whether this step's coefficient is 1 before backward starts (offload/eager.py says why it matters)."""
        trainer = model.trainer
        return bool(
            self.config.offload_step_in_backward
            and self.precision_plugin.scaler is None
            and self.config.nonfinite == "ignore"  # a skip must leave the state untouched (engine.py [Note: non-finite steps])
            and not trainer.gradient_clip_val
            and trainer.accumulate_grad_batches == 1
            and model.automatic_optimization
            and not is_overridden("configure_gradient_clipping", model, pl.LightningModule)
            and not is_overridden("optimizer_step", model, pl.LightningModule)
        )

    @property
    def pipeline_bubble(self) -> Optional[dict[str, Optional[float]]]:
        """Pipeline runs: theoretical and measured idle fraction per stage (pipeline/timing.py), for logging."""
        return self._pipeline.bubble if self._pipeline is not None else None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Pipeline runs: a training batch size that micro-batches cannot divide fails here, before training."""
        if self._pipeline is not None and self.lightning_module is not None:
            self._pipeline.check_dataloader(dataloader, self.lightning_module.trainer.training)
        return dataloader

    # ------------------------------------------------------------------ collectives for Lightning (environment.py)
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        E.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return E.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        return E.reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return E.all_gather(tensor, group)

    # ------------------------------------------------------------------ checkpoints (checkpoint/strategy_io.py)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def checkpointer(self) -> ShardedCheckpointer:
        return self._checkpoints.checkpointer

    def full_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights by name, loadable by the plain model: gathered onto every rank
        (collective: every rank must call it)."""
        return self._checkpoints.full_state_dict()

    def _full_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpoints.full_optimizer_state(optimizer)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint save has finished (raises its error, if any)."""
        self._checkpoints.wait_for_checkpoint()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._checkpoints.save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self._checkpoints.load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._checkpoints.load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ teardown / registry
    @override
    def teardown(self) -> None:
        if self._layer_synced and self.model is not None:  # before the engines guard the modules (layer_sync.py)
            assert self._layer_sync is not None
            self.model = self._layer_sync.revert(self.model)
            self._layer_synced = False
        self._close_manual_window()
        self._placeholders.clear()
        self._zero.teardown(self._checkpoints.wait_for_checkpoint)
        if self.model is not None and needs_restore(self._zero, self.lightning_module):  # after_fit.py
            restore_module(self._zero, self.lightning_module, self.full_state_dict, self.num_processes)
        if not len(self._zero) and not has_meta_tensors(self.lightning_module):
            super().teardown()
            return
        # Lightning's teardown moves the module and optimizer state to the CPU. Not here: the engines
        # keep fp32 masters and optimizer shards on the device, so `trainer.save_checkpoint()` after
        # fit still gathers them over NCCL, and released ZeRO-3 parameters have no storage to move
        # (a cast-layout module of stages 0-2 was handed back on the CPU above: after_fit.py).
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_presets(strategy_registry, ZeroStrategy)



def _loop_kind(trainer: Optional["pl.Trainer"]) -> Optional[str]:
    if trainer is None:
        return None
    for kind, flag in (("train", trainer.training), ("val", trainer.validating or trainer.sanity_checking),
                       ("test", trainer.testing), ("predict", trainer.predicting)):
        if flag:
            return kind
    return None
