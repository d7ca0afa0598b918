"""ZeroStrategy: the Trainer's front door to the ZeRO engines. No ZeRO math lives here.

Reading order of one fit: ``setup_environment`` (process groups, via :class:`ParallelDims`) ->
``setup`` (model to device, replicas made identical, ``configure_optimizers``, one engine per
optimizer, the rest of the module cast to the compute dtype) -> per batch: ``backward`` (engine hooks
reduce buckets) -> ``post_backward`` (engines finish reducing) -> ``optimizer_step`` (closure,
Lightning's hooks and clipping request, ``engine.step``) -> checkpoints through
``checkpoint/strategy_io.py`` -> ``teardown``. What the Fabric front door shares with this one is in
core.py ([Note: one engine, two front doors]); this file keeps the Trainer's order of calls.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

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
from lightning_zero.config import LossScaleConfig, ZeroConfig
from lightning_zero.config.presets import register_presets
from lightning_zero.core import ENGINES, ZeroCore
from lightning_zero.pipeline.integration import PipelineIntegration
from lightning_zero.precision import ZeroPrecision
from lightning_zero.uneven import check_eval_lengths, check_training_epoch, gather_lengths
from lightning_zero.zero.materialize import params_on_meta
from lightning_zero.zero.stage3 import Stage3Engine

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "ZeroStrategy"]


class ZeroStrategy(ZeroCore, ParallelStrategy):
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
        self._init_core(stage, loss_scale, options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1

    @property
    def _zero_module(self) -> Optional[torch.nn.Module]:
        return self.lightning_module

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def is_distributed(self) -> bool:
        """Lightning's connector special-cases its own strategies by isinstance; custom ones must say
        this, or the Trainer adds no DistributedSampler and every rank trains on the same data."""
        return True

    @property  # type: ignore[override]
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
        self._precision_plugin = zp

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
        self._setup_zero_environment()
        assert self.dims is not None
        if self.lightning_module is not None:  # configure_model reads self.device_mesh, as under ModelParallelStrategy
            self.lightning_module._device_mesh = self.device_mesh
        self._pipeline = PipelineIntegration(self.config, self.dims, self.root_device) if self.dims.pp > 1 else None
        if self._pipeline is not None:  # build only this stage's layers, before Lightning's hooks touch them
            self._pipeline.place(self.lightning_module)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._pipeline is not None:  # this stage's layers only, tied copies made equal
            self._pipeline.prepare(self.model)
        self._prepare_module(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self._unshard_previous_engines()  # a second fit
            self.setup_optimizers(trainer)
            self._build_engines(self.lightning_module, self.optimizers, trainer.accumulate_grad_batches > 1)
            if self._pipeline is None:  # pipeline stages run backward inside training_step, before Lightning's
                # zero_grad (which comes between training_step and backward): it must not discard their gradients
                self._route_zero_grad([*self.optimizers, *self._lightning_optimizers])
            self._reserve_async_staging()
        else:
            for engine in self._engines.values():  # validate/test/predict after fit: gather per unit again
                if isinstance(engine, Stage3Engine):
                    engine.install_module_hooks()
        self._finish_setup(self.model)
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
        self._watch_first(_loop_kind(trainer))
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._begin_step("train"):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._begin_step("val"):
                return super().validation_step(*args, **kwargs)
        finally:
            self._end_eval_step()

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._begin_step("test"):
                return super().test_step(*args, **kwargs)
        finally:
            self._end_eval_step()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._begin_step("predict"):
                return super().predict_step(*args, **kwargs)
        finally:
            self._end_eval_step()

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
        self._note_failure(exception)  # core.py: reported once, no collectives from here on

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self._place(self.model)  # meta: materialised later, unit by unit

    # ------------------------------------------------------------------ training step plumbing
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: stages 0/1 keep accumulating locally; stage 2 reduces anyway."""
        with self._sync_blocked():
            yield None

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self._post_backward()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        engine = self._engine_of(optimizer)
        if engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        self._before_backward(engine)
        if hasattr(engine, "step_in_backward"):
            engine.step_in_backward = self._step_can_run_in_backward(model)
        result = closure()
        precision = self.precision_plugin
        precision._after_closure(model, optimizer)
        clip = precision.pop_clip_value()
        if result is None and model.automatic_optimization:
            engine._zero_grads()  # training_step returned None: skip the step, as torch would
            return None
        self._step_engine(engine, clip)
        return result

    def _step_index(self, engine: Any) -> int:
        """The Trainer's ``global_step`` (restored on resume) when one optimizer steps per batch."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and len(self._engines) == 1:
            return int(trainer.global_step)
        return super()._step_index(engine)

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

    # ------------------------------------------------------------------ collectives for Lightning
    # barrier, broadcast and all_gather: core.py (the same for both front ends)
    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        return self._reduce(tensor, group, reduce_op)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    # ------------------------------------------------------------------ teardown / registry
    @override
    def teardown(self) -> None:
        self._teardown_engines()
        if not self._engines:
            super().teardown()
            return
        # Lightning's teardown moves the module and optimizer state to the CPU. Not here: the engines
        # keep fp32 masters and optimizer shards on the device, so `trainer.save_checkpoint()` after
        # fit still gathers them over NCCL, and released ZeRO-3 parameters have no storage to move.
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
