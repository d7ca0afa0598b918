"""ZeroStrategy: Lightning lifecycle glue around the ZeRO engines. No ZeRO math lives here.

Reading order of one fit: ``setup_environment`` (process groups, via :class:`ParallelDims`) ->
``setup`` (model to device, replicas made identical, ``configure_optimizers``, one engine per
optimizer, the rest of the module cast to the compute dtype) -> per batch: ``backward`` (engine hooks
reduce buckets) -> ``post_backward`` (engines finish reducing) -> ``optimizer_step`` (closure,
Lightning's hooks and clipping request, ``engine.step``) -> checkpoints through
``checkpoint/strategy_io.py`` -> ``teardown``.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Generator, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_zero.activations.policy import apply_activation_offload
from lightning_zero.checkpoint.strategy_io import CheckpointMixin
from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed import protocol as compressed_comm
from lightning_zero.config import LossScaleConfig, ZeroConfig
from lightning_zero.failures import FailureBoard, PeerWatchdog, hold_sigterm, print_once, start_watchdog
from lightning_zero.offload.engines import offload_engine
from lightning_zero.offload.settings import OffloadSettings
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.pipeline.integration import PipelineIntegration
from lightning_zero.precision import ZeroPrecision
from lightning_zero.zero.buffers import BufferSync
from lightning_zero.zero.compile import CompilePlan, compile_for_strategy
from lightning_zero.zero.read_watch import ReadWatch, explain_released_read
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.stage1 import Stage1Engine
from lightning_zero.zero.stage2 import Stage2Engine
from lightning_zero.zero.stage3 import Stage3Engine, guard_released_modules
from lightning_zero.zero.materialize import has_meta_params, make_unit_materializer, materialize_modules, params_on_meta

log = logging.getLogger(__name__)

ENGINES: dict[int, type[ZeroEngine]] = {0: ZeroEngine, 1: Stage1Engine, 2: Stage2Engine, 3: Stage3Engine}


class ZeroStrategy(CheckpointMixin, ParallelStrategy):
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
        if self.config.stage == 3 and 3 not in ENGINES:
            raise NotImplementedError("ZeRO stage 3 is not available in this version of lightning_zero.")
        self._loss_scale = loss_scale
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self.dims: Optional[ParallelDims] = None
        self._engines: dict[int, ZeroEngine] = {}
        self._orig_dtypes: dict[str, torch.dtype] = {}
        self._guards: list = []
        self._pipeline: Optional[PipelineIntegration] = None
        self._buffer_sync: Optional[BufferSync] = None
        self._watched: set[str] = set()
        """Step kinds whose first batch ran under stage 3's ReadWatch (read_watch.py)."""
        self._watch: Optional[ReadWatch] = None
        self._watchdog: Optional[PeerWatchdog] = None
        self._failed = False
        """Set by on_exception: teardown then releases everything without a collective."""
        self.compile_plan: Optional[CompilePlan] = None
        """What zero/compile.py compiled or made eager at the last setup (None: nothing to do)."""

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def is_distributed(self) -> bool:
        """Lightning's connector special-cases its own strategies by isinstance; custom ones must say
        this, or the Trainer adds no DistributedSampler and every rank trains on the same data."""
        return True

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
        if self.dims is not None:
            return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

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
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self.dims = ParallelDims(self.world_size, self.global_rank, pp=self.config.pipeline_stages)
        backend = self.config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        if self.world_size > 1 or C.is_initialized():
            from datetime import timedelta

            _init_dist_connection(self.cluster_environment, backend, timeout=timedelta(seconds=self.config.timeout_s))
        self.dims.build_groups(self.config.timeout_s)
        self._setup_checkpointer()
        self._failed = False
        if self._watchdog is None:  # failures.py [Note: failing once]
            self._watchdog = start_watchdog([self._remove_swap_dirs])
        self._pipeline = PipelineIntegration(self.config, self.dims, self.root_device) if self.dims.pp > 1 else None
        if self._pipeline is not None:  # build only this stage's layers, before Lightning's hooks touch them
            self._pipeline.place(self.lightning_module)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._pipeline is not None:  # this stage's layers only, tied copies made equal
            self._pipeline.prepare(self.model)
        self.model_to_device()
        self._broadcast_module_states()
        self._orig_dtypes = {k: v.dtype for k, v in self.model.state_dict().items() if torch.is_tensor(v)}
        for guard in self._guards:
            guard.remove()
        self._guards = []
        if trainer.state.fn == TrainerFn.FITTING:
            for old in self._engines.values():  # a second fit: parameters get full storage back first
                if isinstance(old, Stage3Engine):
                    old.unshard_to_plain()
            self.setup_optimizers(trainer)
            self._build_engines()
            self._reserve_async_staging()
        else:
            for engine in self._engines.values():  # validate/test/predict after fit: gather per unit again
                if isinstance(engine, Stage3Engine):
                    engine.install_module_hooks()
        if has_meta_params(self.model):  # not fitting, or parameters outside every optimizer
            materialize_modules(list(self.model.modules()), self.root_device)
        self.precision_plugin.convert_module(self.model)
        self.compile_plan = compile_for_strategy(  # the one call site of torch.compile (zero/compile.py)
            self.lightning_module, [u for e in self._stage3_engines()[:1] for u in e.units[1:]], self.config)
        if self.config.activation_offload:  # the one call site: activations/policy.py [Note: the strategy option]
            units = [u.module for e in self._stage3_engines() for u in e.units[1:] if u.module is not None]
            apply_activation_offload(self.model, self.config.activation_offload_policy, units)
        for engine in self._engines.values():
            for fg in engine.groups:
                for p in fg.params:
                    if p.dtype != fg.compute_dtype:  # pragma: no cover - guards the view invariant
                        raise RuntimeError("A ZeRO-managed parameter lost its flat-buffer view.")
        if self._pipeline is not None:  # from now on pipe((inputs, labels)) runs the schedule
            self._pipeline.attach(trainer, self.engines, lambda: self.precision_plugin.loss_scale)
        group = self.dims.dp_group if self.dims is not None else None
        self._buffer_sync = BufferSync(self.model, group)
        self._watched = set()

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` builds parameters on the meta device (materialize.py)."""
        if self.config.stage != 3:
            yield
            return
        with params_on_meta():
            yield

    @contextmanager
    def gathered_params(
        self, module: Optional[torch.nn.Module] = None, writeback: bool = False
    ) -> Generator[None, None, None]:
        """Full parameters of ``module`` (default: all) inside the block, e.g. for generation or export.

        A no-op below stage 3. Under stage 3 it is collective: every rank must enter it.
        """
        with ExitStack() as stack:
            for engine in self._stage3_engines():
                stack.enter_context(engine.gathered_params(module, writeback))
            yield

    def _stage3_engines(self) -> list[Stage3Engine]:
        return [e for e in self._engines.values() if isinstance(e, Stage3Engine)]

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """A new batch: the first of each kind (train, val, test, predict) runs under ReadWatch, from
        here to the next batch (read_watch.py)."""
        self._end_watch()
        engines = self._stage3_engines()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        kind = _loop_kind(trainer)
        if engines and kind is not None and kind not in self._watched:
            self._watched.add(kind)
            self._watch = ReadWatch(engines)
            self._watch.__enter__()
        return super().batch_to_device(batch, device, dataloader_idx)

    def _end_watch(self) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)

    @contextmanager
    def _begin_step(self, kind: str) -> Generator[None, None, None]:
        """Buffers from rank 0 (buffers.py), stage-3 root and resident units gathered; a first batch's
        ReadWatch gathers what the step reads outside units (read_watch.py)."""
        if self._buffer_sync is not None and kind in ("train", "val"):
            self._buffer_sync.sync()
        for engine in self._stage3_engines():
            engine.begin_step()
        watch = self._watch
        if watch is not None:
            watch.gathering = True
        try:
            yield
        finally:
            if watch is not None:
                watch.gathering = False

    def _end_eval_step(self) -> None:
        for engine in self._stage3_engines():
            engine.end_eval_step()

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

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failure on this rank: reported in full once across ranks (failures.py [Note: failing
        once]); teardown will release engines without collectives; an async checkpoint save still
        writing gets a bounded wait. Torch's error on a released ZeRO-3 parameter becomes one that
        says where and what to do."""
        self._end_watch()
        self._failed = True
        hold_sigterm()  # the cleanup below and in teardown runs to its end
        if self._watchdog is not None:
            self._watchdog.own_failure = True
        if self._checkpointer is not None:
            self._checkpointer.wait_or_abandon(timeout_s=60.0)
        if not isinstance(exception, KeyboardInterrupt):
            print_once(FailureBoard.for_default_group(), exception)  # the main thread's own store client
        released = {id(p): self._param_name(p) for e in self._stage3_engines() for p in e.sharded_params()}
        message = explain_released_read(exception, released) if released else None
        if message is not None:
            exception.args = (message,)

    def _param_name(self, param: torch.nn.Parameter) -> str:
        for engine in self._engines.values():
            name = engine.param_names.get(id(param))
            if name is not None:
                return name
        return "a parameter"

    def _build_engines(self) -> None:
        assert self.dims is not None and self.lightning_module is not None
        engine_cls = ENGINES[self.config.stage]
        stage_options: dict[str, Any] = {}
        names = {id(p): n for n, p in self.lightning_module.named_parameters(remove_duplicate=False)}
        _check_optimizers_own_their_params(self.optimizers, names)
        if self.config.stage == 3:
            lm = self.lightning_module
            stage_options = {
                "module": lm,
                "param_group": self.dims.dp_param_group,
                "unit_policy": self.config.unit_policy,
                "prefetch_units": self.config.prefetch_units,
                "max_live_parameters": self.config.max_live_parameters,
                "param_persistence_threshold": self.config.param_persistence_threshold,
                "materialize": make_unit_materializer(lm, self.root_device, getattr(lm, "zero_init_module", None)),
            }
        if self.config.offloads:  # ZeRO-Offload / ZeRO-Infinity: the stage's engine with offload mixed in
            engine_cls = offload_engine(self.config.stage)
            trainer = self.lightning_module.trainer if self.lightning_module._trainer is not None else None
            accumulate = trainer is not None and trainer.accumulate_grad_batches > 1
            stage_options["offload"] = OffloadSettings(self.config, self.num_processes, self.global_rank, accumulate)
        dtype = self.precision_plugin.compute_dtype
        bucket_numel = max(1, int(self.config.bucket_size_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
        norm_groups = [self.dims.pp_group] if self.dims.pp > 1 else []
        self._engines = {}
        frozen = _frozen_params(self.lightning_module, self.optimizers) if self.config.stage == 3 else []
        for i, opt in enumerate(self.optimizers):
            compressed_comm.attach_backend(opt, self.config.stage, self.dims.dp_group)  # 1-bit optimizers only
            engine = engine_cls(
                opt,
                self.dims.dp_group,
                dtype,
                self.root_device,
                bucket_numel,
                norm_groups=norm_groups,
                param_names=names,
                **stage_options,
                **({"frozen_params": frozen} if i == 0 and frozen else {}),
            )
            self._engines[id(opt)] = engine
        if self._pipeline is None:  # pipeline stages run backward inside training_step, before Lightning's
            # zero_grad (which comes between training_step and backward): it must not discard their gradients
            for opt in [*self.optimizers, *self._lightning_optimizers]:
                engine = self._engines.get(id(getattr(opt, "_optimizer", opt)))
                if engine is not None:  # engine.py [Note: the optimizer keeps the model's parameters]
                    opt.zero_grad = engine.zero_grad  # type: ignore[method-assign]

    def _broadcast_module_states(self) -> None:
        """Make every replica start from rank 0's weights and buffers (as DDP does at wrap time)."""
        assert self.model is not None
        if C.world_size() == 1:
            return
        group = self.dims.dp_group if self.dims is not None else None
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                # meta parameters are materialised identically on every rank; released ZeRO-3 ones are
                # consistent already (their shards are)
                if not t.is_meta and t.untyped_storage().nbytes() > 0:
                    C.broadcast(t.data, 0, group)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        device = self.root_device
        self.model._apply(lambda t: t if t.is_meta else t.to(device))  # meta: materialised later, unit by unit

    # ------------------------------------------------------------------ training step plumbing
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: stages 0/1 keep accumulating locally; stage 2 reduces anyway."""
        for engine in self._engines.values():
            engine.require_sync = False
        try:
            yield None
        finally:
            for engine in self._engines.values():
                engine.require_sync = True

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        for engine in self._engines.values():
            engine.post_backward()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        engine = self._engines.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        engine.reduce_gradients = compressed_comm.gradient_allreduce_needed(engine.optimizer)
        if hasattr(engine, "step_in_backward"):
            engine.step_in_backward = self._step_can_run_in_backward(model)
        result = closure()
        precision = self.precision_plugin
        precision._after_closure(model, optimizer)
        clip = precision.pop_clip_value()
        if result is None and model.automatic_optimization:
            engine._zero_grads()  # training_step returned None: skip the step, as torch would
            return None
        stepped = engine.step(clip, precision.scaler)
        if not stepped:
            rank_zero_only(log.warning)(
                f"fp16 gradient overflow: step skipped on every rank, loss scale now {precision.loss_scale:g}"
            )
        return result

    def _step_can_run_in_backward(self, model: "pl.LightningModule") -> bool:
        """Whether this step's coefficient is 1 before backward starts (offload/eager.py says why it matters)."""
        trainer = model.trainer
        return bool(
            self.config.offload_step_in_backward
            and self.precision_plugin.scaler is None
            and not trainer.gradient_clip_val
            and trainer.accumulate_grad_batches == 1
            and model.automatic_optimization
            and not is_overridden("configure_gradient_clipping", model, pl.LightningModule)
            and not is_overridden("optimizer_step", model, pl.LightningModule)
        )

    @property
    def grad_norm(self) -> Optional[float]:
        """Global gradient norm (unscaled, before clipping) of the last step, for logging."""
        norms = [e.grad_norm for e in self._engines.values() if e.grad_norm is not None]
        return float(sum(n * n for n in norms) ** 0.5) if norms else None

    @property
    def loss_scale(self) -> Optional[float]:
        return self.precision_plugin.loss_scale

    @property
    def skipped_steps(self) -> int:
        scaler = self.precision_plugin.scaler
        return scaler.overflows if scaler is not None else 0

    @property
    def engines(self) -> list[ZeroEngine]:
        return list(self._engines.values())

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
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        C.barrier(None, device_ids=ids)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return C.broadcast_object(obj, src, None)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, Tensor) or C.world_size(group) == 1:
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        if op in ("avg", "mean"):
            out = tensor.detach().clone().float() if not tensor.is_floating_point() else tensor.detach().clone()
            C.all_reduce(out, group, "sum")
            return out / C.world_size(group)
        if op not in ("sum", "max", "min"):
            raise ValueError(f"reduce_op must be one of 'mean', 'sum', 'max', 'min'; got {reduce_op!r}")
        out = tensor.detach().clone()
        C.all_reduce(out, group, op)
        return out

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        n = C.world_size(group)
        t = tensor.contiguous()
        out = [torch.empty_like(t) for _ in range(n)]
        C.all_gather_list(out, t, group)
        return torch.stack(out)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    # ------------------------------------------------------------------ teardown / registry
    def _remove_swap_dirs(self) -> None:
        """The watchdog's cleanup when a peer failed and this process is ended (no collective)."""
        for engine in list(self._engines.values()):
            swap = getattr(engine, "swap_dir", None)
            path = swap() if callable(swap) else None
            if path:
                shutil.rmtree(path, ignore_errors=True)

    @override
    def teardown(self) -> None:
        self._end_watch()
        if self._watchdog is not None:  # joined: a daemon thread inside a store call at interpreter exit aborts it
            self._watchdog.stop()
            self._watchdog.join(timeout=5.0)
            self._watchdog = None
        C.destroy_groups_at_exit(not self._failed)  # comm/collectives.py [Note: destroy at exit]
        if self._failed:  # after an exception: no collective (a peer may be gone), threads joined, swap removed
            for engine in self._engines.values():
                engine.abandon()
        else:
            self.wait_for_checkpoint()  # an async save still writing: the fit ends when it is on disk
            for engine in self._engines.values():
                engine.teardown()  # offload: finish a delayed step, release swap files
                engine.remove_hooks()  # engines stay: trainer.save_checkpoint() after fit still gathers shards
                if isinstance(engine, Stage3Engine) and self.lightning_module is not None:
                    engine.end_eval_step()
                    self._guards += guard_released_modules(self.lightning_module, engine)
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
        from lightning_zero.registry import register_all

        register_all(strategy_registry)


def _check_optimizers_own_their_params(optimizers: list[Optimizer], names: dict[int, str]) -> None:
    """Each parameter in at most one optimizer: its partition and optimizer state exist once."""
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for pg in opt.param_groups:
            for p in pg["params"]:
                j = owner.setdefault(id(p), i)
                if j != i:
                    raise ValueError(
                        f"Parameter '{names.get(id(p), '?')}' is in optimizer {j} ({type(optimizers[j]).__name__}) and in "
                        f"optimizer {i} ({type(opt).__name__}). ZeRO keeps one partition and one optimizer state per "
                        "parameter: give every parameter to exactly one optimizer in configure_optimizers."
                    )


def _frozen_params(module: torch.nn.Module, optimizers: list[Optimizer]) -> list[torch.nn.Parameter]:
    """Stage 3 partitions these too, without gradients, masters or optimizer state: parameters with
    ``requires_grad=False`` or in no optimizer (the frozen base of a LoRA fine-tune). Non-floating
    parameters stay replicated."""
    trainable = {id(p) for opt in optimizers for pg in opt.param_groups for p in pg["params"] if p.requires_grad}
    return [p for p in module.parameters() if id(p) not in trainable and p.is_floating_point()]


def _loop_kind(trainer: Optional["pl.Trainer"]) -> Optional[str]:
    if trainer is None:
        return None
    for kind, flag in (("train", trainer.training), ("val", trainer.validating or trainer.sanity_checking),
                       ("test", trainer.testing), ("predict", trainer.predicting)):
        if flag:
            return kind
    return None
