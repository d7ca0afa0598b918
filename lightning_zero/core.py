"""ZeroCore: the Lightning glue that the Trainer and the Fabric front doors share.

[Note: one engine, two front doors]
``ZeroStrategy`` (strategy.py, the Trainer's strategy class tree) and ``ZeroFabricStrategy``
(fabric/strategy.py, Fabric's tree) derive from different Lightning base classes, so what they have
in common lives here, as a mixin both put first in their bases: the process groups
(:meth:`_setup_zero_environment`), the module's preparation and the engines' construction
(:meth:`_prepare_module`, :meth:`_build_engines`, :meth:`_finish_setup`), the step boundaries of
stage 3 (:meth:`_begin_step`, ReadWatch), backward and step plumbing (:meth:`_sync_blocked`,
:meth:`_post_backward`, :meth:`_step_engine`), the collectives Lightning asks for, failure handling,
teardown of the engines, and the checkpoint hooks (checkpoint/strategy_io.py). Each front end keeps
only what its framework calls and in what order; neither holds ZeRO math (zero/, offload/).

The mixin expects of its host: ``root_device``, ``global_rank``, ``world_size``, ``num_processes``,
``node_rank``, ``local_rank``, ``cluster_environment``, ``optimizers`` (the set-up optimizers),
``_zero_module`` (the module the engines manage) and ``precision_plugin`` (a ZeroPrecision).
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generator, Iterable, Optional, Union

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.activations.policy import apply_activation_offload
from lightning_zero.checkpoint.strategy_io import CheckpointMixin
from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed import protocol as compressed_comm
from lightning_zero.config import LossScaleConfig, OffloadConfig, Stage3Config, ZeroConfig
from lightning_zero.failures import FailureBoard, PeerWatchdog, hold_sigterm, print_once, start_watchdog
from lightning_zero.moe.parallel import bind_expert_parallel
from lightning_zero.offload.engines import offload_engine
from lightning_zero.offload.settings import OffloadHost
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.parallel.validate import check_tensor_parallel
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.pipeline.integration import PipelineIntegration
from lightning_zero.zero.buffers import BufferSync
from lightning_zero.zero.compile import CompilePlan, compile_for_strategy
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.materialize import has_meta_params, make_unit_materializer, materialize_modules
from lightning_zero.zero.read_watch import ReadWatch, explain_released_read
from lightning_zero.zero.shard_comm import ShardComm, is_expert
from lightning_zero.zero.stage1 import Stage1Engine
from lightning_zero.zero.stage2 import Stage2Engine
from lightning_zero.zero.stage3 import Stage3Engine, guard_released_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

ENGINES: dict[int, type[ZeroEngine]] = {0: ZeroEngine, 1: Stage1Engine, 2: Stage2Engine, 3: Stage3Engine}


class ZeroCore(CheckpointMixin):
    """Shared state and glue of the ZeRO front ends (see [Note: one engine, two front doors])."""

    config: ZeroConfig

    # ------------------------------------------------------------------ Lightning plumbing (both doors)
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # type: ignore[attr-defined]
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is sharded by data-parallel rank only: the stages of one pipeline see the same batch."""
        if self.dims is not None:
            return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    def _init_core(self, stage: int, loss_scale: Optional[Union[LossScaleConfig, dict]], options: dict[str, Any]) -> None:
        """Validate the options (an unknown one is an error naming the valid ones) and start empty.
        Called before the Lightning base's ``__init__``: its precision setter reads ``_loss_scale``."""
        self.config = ZeroConfig.from_kwargs(stage=stage, **options)
        if self.config.stage == 3 and 3 not in ENGINES:
            raise NotImplementedError("ZeRO stage 3 is not available in this version of lightning_zero.")
        self._loss_scale = loss_scale
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
        """Set by a failure: teardown then releases everything without a collective."""
        self.compile_plan: Optional[CompilePlan] = None
        """What zero/compile.py compiled or made eager at the last setup (None: nothing to do)."""
        self._steps_seen: dict[int, int] = {}
        """Optimizer steps taken or skipped, by engine id (for messages)."""
        self._nonfinite_skipped = 0
        """Steps skipped for a non-finite gradient (fp32/bf16; fp16's skips are its scaler's)."""
        self._nonfinite_in_a_row = 0

    @property
    def _zero_module(self) -> Optional[torch.nn.Module]:  # pragma: no cover - each front end says
        raise NotImplementedError

    # ------------------------------------------------------------------ environment
    def _setup_zero_environment(self, watchdog: bool = True) -> None:
        """After the accelerator set its device up: ranks, the default process group, this job's
        groups (ParallelDims), the checkpoint group and, optionally, the peer watchdog."""
        reset_seed()
        self._set_world_ranks()
        env = self.cluster_environment  # type: ignore[attr-defined]
        self.dims = ParallelDims(  # type: ignore[attr-defined]
            self.world_size, self.global_rank, pp=self.config.pipeline_stages, tp=self.config.tensor_parallel,
            ep=self.config.expert_parallel)
        backend = self.config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)  # type: ignore[attr-defined]
        if self.world_size > 1 or C.is_initialized():  # type: ignore[attr-defined]
            _init_dist_connection(env, backend, timeout=timedelta(seconds=self.config.timeout_s))
        self.dims.build_groups(self.config.timeout_s, self.root_device.type)  # type: ignore[attr-defined]
        self._setup_checkpointer()
        self._failed = False
        C.destroy_groups_at_exit(True)  # comm/collectives.py [Note: destroy at exit]; Fabric calls no teardown
        if watchdog and self._watchdog is None:  # failures.py [Note: failing once]
            self._watchdog = start_watchdog([self._remove_swap_dirs])

    def _set_world_ranks(self) -> None:
        """This process's global rank and the world size, from the node and local ranks (Fabric's
        connector calls it under this name too, so ``fabric.global_rank`` is right before launch)."""
        env = self.cluster_environment  # type: ignore[attr-defined]
        if env is None:
            return
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
        env.set_world_size(self._num_nodes * self.num_processes)  # type: ignore[attr-defined]
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The ``("pp", "dp", "tp")`` DeviceMesh of this job (parallel_dims.py [Note: one mesh]), as
        Lightning's ``ModelParallelStrategy`` exposes its own; ``configure_model`` applies tensor
        parallelism with ``self.device_mesh["tp"]``. None before ``setup_environment`` and in a single
        process without a process group."""
        return self.dims.mesh if self.dims is not None else None

    @property
    def expert_parallel_group(self) -> Optional[C.ProcessGroup]:
        """This rank's expert-parallel group (``expert_parallel`` > 1; parallel_dims.py [Note:
        expert-parallel groups]), for ``MoE(..., ep_group=...)`` built in ``configure_model``; layers
        built with ``ep_size`` get it at setup anyway (moe/parallel.py [Note: who tells a layer its
        group]). None before ``setup_environment`` and without expert parallelism."""
        return self.dims.ep_group if self.dims is not None else None

    # ------------------------------------------------------------------ setup
    def _prepare_module(self, module: torch.nn.Module) -> None:
        """On this rank's device (meta parameters stay meta: materialised later, unit by unit), with
        rank 0's weights and buffers; remembers the dtypes the checkpoints restore."""
        if self.dims is not None and self.dims.tp > 1:
            check_tensor_parallel(module, self.dims.tp)
        bind_expert_parallel(module, self.config.expert_parallel, self.expert_parallel_group)  # before the broadcast
        self._place(module)
        self._broadcast_module_states(module)
        self._orig_dtypes = {k: v.dtype for k, v in module.state_dict().items() if torch.is_tensor(v)}
        for guard in self._guards:
            guard.remove()
        self._guards = []

    def _place(self, module: torch.nn.Module) -> None:
        device = self.root_device  # type: ignore[attr-defined]
        module._apply(lambda t: t if t.is_meta else t.to(device))

    def _broadcast_module_states(self, module: torch.nn.Module) -> None:
        """Make every replica start from rank 0's weights and buffers (as DDP does at wrap time)."""
        if C.world_size() == 1:
            return
        group = self.dims.dp_group if self.dims is not None else None
        expert_group = self.dims.edp_group if self.dims is not None and self.dims.ep > 1 else group
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                src_group = expert_group if is_expert(t) else group  # the replicas of the same experts only
                # meta parameters are materialised identically on every rank; released ZeRO-3 ones are
                # consistent already (their shards are)
                t = local_tensor(t)  # a DTensor's TP shard: the dp ranks of one tp rank hold the same one
                if not t.is_meta and t.untyped_storage().nbytes() > 0:
                    C.broadcast(t.data, 0, src_group)

    def _unshard_previous_engines(self) -> None:
        """A second setup: parameters of stage-3 engines get their full storage back first."""
        for old in self._engines.values():
            if isinstance(old, Stage3Engine):
                old.unshard_to_plain()

    def _build_engines(self, module: torch.nn.Module, optimizers: list[Optimizer], accumulate: bool,
                       only: Optional[list[Optimizer]] = None) -> None:
        """One engine per optimizer (stage and offload from the config). ``accumulate``: whether the
        loop accumulates gradients over several backwards (offload's host-memory check counts the
        accumulator). ``only``: add engines for these optimizers, keeping the existing ones (Fabric's
        ``setup_optimizers`` after ``setup_module``, stages 0-2); by default every engine is new."""
        assert self.dims is not None
        engine_cls = ENGINES[self.config.stage]
        stage_options: dict[str, Any] = {}
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        check_optimizers_own_their_params(optimizers, names)
        if self.config.stage == 3:
            stage_options = {
                "module": module,
                "param_group": self.dims.dp_param_group,
                "stage3": self.config.piece(Stage3Config),
                "materialize": make_unit_materializer(module, self.root_device, getattr(module, "zero_init_module", None)),  # type: ignore[attr-defined]
            }
        if self.config.offloads:  # ZeRO-Offload / ZeRO-Infinity: the stage's engine with offload mixed in
            engine_cls = offload_engine(self.config.stage)
            stage_options["offload"] = self.config.piece(OffloadConfig)
            stage_options["offload_host"] = OffloadHost(self.num_processes, self.global_rank, accumulate)  # type: ignore[attr-defined]
        dtype = self.precision_plugin.compute_dtype  # type: ignore[attr-defined]
        bucket_numel = max(1, int(self.config.bucket_size_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
        norm_groups = [self.dims.pp_group] if self.dims.pp > 1 else []
        frozen = frozen_params(module, optimizers) if self.config.stage == 3 else []
        if only is None:
            self._engines = {}
        experts = ShardComm.over(self.dims.edp_group, self.dims.edp_param_group) if self.dims.ep > 1 else None
        for i, opt in enumerate(optimizers if only is None else only):
            if experts is not None and compressed_comm.uses_compressed_comm(opt):
                raise NotImplementedError(f"{type(opt).__name__} with expert_parallel > 1 is not built yet.")
            compressed_comm.attach_backend(opt, self.config.stage, self.dims.dp_group)  # 1-bit optimizers only
            self._engines[id(opt)] = engine_cls(
                opt,
                self.dims.dp_group,
                dtype,
                self.root_device,  # type: ignore[attr-defined]
                bucket_numel,
                norm_groups=norm_groups,
                param_names=names,
                **({"tp_group": self.dims.tp_group} if self.dims.tp > 1 else {}),
                **({"expert_comm": experts} if experts is not None else {}),
                **stage_options,
                **({"frozen_params": frozen} if i == 0 and frozen else {}),
            )

    def _route_zero_grad(self, optimizers: Iterable[Any]) -> None:
        """engine.py [Note: the optimizer keeps the model's parameters]: ``zero_grad`` discards what the
        engine accumulated."""
        for opt in optimizers:
            engine = self._engines.get(id(getattr(opt, "_optimizer", opt)))
            if engine is not None:
                opt.zero_grad = engine.zero_grad

    def _finish_setup(self, module: torch.nn.Module) -> None:
        """After the engines exist: meta parameters outside every engine materialised, the module cast
        to the compute dtype (the fp32 masters were taken before), compile and activation offload
        applied at their one call site each, buffers followed from rank 0."""
        if has_meta_params(module):  # not fitting, or parameters outside every optimizer
            materialize_modules(list(module.modules()), self.root_device)  # type: ignore[attr-defined]
        self.precision_plugin.cast_module(module)  # type: ignore[attr-defined]
        self.compile_plan = compile_for_strategy(  # the one call site of torch.compile (zero/compile.py)
            module, [u for e in self._stage3_engines()[:1] for u in e.units[1:]], self.config)
        if self.config.activation_offload:  # the one call site: activations/policy.py [Note: the strategy option]
            units = [u.module for e in self._stage3_engines() for u in e.units[1:] if u.module is not None]
            apply_activation_offload(module, self.config.activation_offload_policy, units)
        for engine in self._engines.values():
            for fg in engine.groups:
                for p in fg.params:
                    if p.dtype != fg.compute_dtype:  # pragma: no cover - guards the view invariant
                        raise RuntimeError("A ZeRO-managed parameter lost its flat-buffer view.")
        group = self.dims.dp_group if self.dims is not None else None
        self._buffer_sync = BufferSync(module, group)
        self._watched = set()

    # ------------------------------------------------------------------ stage 3 step boundaries
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

    def _watch_first(self, kind: Optional[str]) -> None:
        """A new batch: the previous one's watch ends; the first batch of each kind runs under ReadWatch
        until the next batch (read_watch.py)."""
        self._end_watch()
        engines = self._stage3_engines()
        if engines and kind is not None and kind not in self._watched:
            self._watched.add(kind)
            self._watch = ReadWatch(engines)
            self._watch.__enter__()

    def _end_watch(self) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)

    def _start_step(self, kind: str) -> None:
        """Buffers from rank 0 (buffers.py); stage-3 root and resident units gathered."""
        if self._buffer_sync is not None and kind in ("train", "val"):
            self._buffer_sync.sync()
        for engine in self._stage3_engines():
            engine.begin_step()

    @contextmanager
    def _begin_step(self, kind: str) -> Generator[None, None, None]:
        """:meth:`_start_step`, and a first batch's ReadWatch gathers what the step reads outside units."""
        self._start_step(kind)
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

    # ------------------------------------------------------------------ backward and step
    @contextmanager
    def _sync_blocked(self) -> Generator[None, None, None]:
        """Gradient accumulation: stages 0/1 keep accumulating locally; stage 2 reduces anyway."""
        for engine in self._engines.values():
            engine.require_sync = False
        try:
            yield None
        finally:
            for engine in self._engines.values():
                engine.require_sync = True

    def _post_backward(self) -> None:
        for engine in self._engines.values():
            engine.post_backward()

    def _engine_of(self, optimizer: Any) -> Optional[ZeroEngine]:
        return self._engines.get(id(getattr(optimizer, "_optimizer", optimizer)))

    def _before_backward(self, engine: ZeroEngine) -> None:
        """1-bit optimizers decide per step whether gradients are all-reduced at all."""
        engine.reduce_gradients = compressed_comm.gradient_allreduce_needed(engine.optimizer)

    def _step_engine(self, engine: ZeroEngine, clip: Optional[float]) -> bool:
        """Unscale, clip, step and write back through ``engine``; False (and a warning) when the step
        was skipped on every rank: an fp16 overflow, or a non-finite gradient under ``nonfinite='skip'``
        (zero/engine.py [Note: non-finite steps]); ``nonfinite='error'``, or too many skips in a row,
        raise :class:`NonFiniteStepError` on every rank."""
        precision = self.precision_plugin  # type: ignore[attr-defined]
        scaler = precision.scaler
        policy = self.config.nonfinite
        step = self._step_index(engine)
        self._steps_seen[id(engine)] = step + 1
        scale_can_drop = scaler is not None and scaler.scale > scaler.config.min_scale
        # fp16 overflows the scale can still absorb are the scaler's: no search for the culprit
        stepped = engine.step(clip, scaler, check_finite=policy != "ignore" and not scale_can_drop)
        if stepped:
            self._nonfinite_in_a_row = 0
            return True
        if scaler is not None and (policy == "ignore" or scale_can_drop):
            rank_zero_only(log.warning)(
                f"fp16 gradient overflow: step skipped on every rank, loss scale now {precision.loss_scale:g}"
            )
            return False
        self._nonfinite_in_a_row += 1
        if scaler is None:
            self._nonfinite_skipped += 1  # fp16's skips are counted by its scaler
        where = self._where_nonfinite(engine)
        what = f"Non-finite gradient norm ({engine.grad_norm}) at step {step}: {where}"
        if policy == "error":
            raise NonFiniteStepError(f"{what}. Stopping (nonfinite='error'); nonfinite='skip' skips such steps.")
        if self._nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteStepError(
                f"{what}. {self._nonfinite_in_a_row} non-finite steps in a row (max_nonfinite_steps="
                f"{self.config.max_nonfinite_steps}): the run diverged or its data holds NaN/inf; stopping."
            )
        rank_zero_only(log.warning)(
            f"{what}. Step skipped on every rank (weights and optimizer state unchanged; "
            f"{self._nonfinite_in_a_row} in a row of max_nonfinite_steps={self.config.max_nonfinite_steps})."
        )
        return False

    def _step_index(self, engine: ZeroEngine) -> int:
        """The number of this optimizer's steps so far, skipped ones included (the Trainer's
        ``global_step`` for a single optimizer), for messages."""
        return self._steps_seen.get(id(engine), 0)

    def _where_nonfinite(self, engine: ZeroEngine) -> str:
        """Collective (every rank skipped the same step): the first non-finite gradient any rank found
        in its shard, as words."""
        found = [f for f in C.all_gather_object(engine.nonfinite_where, None) if f is not None]
        if not found:
            return "every gradient element is finite, the sum of their squares overflowed (gradients above ~1e19)"
        group, name = min(found, key=lambda f: f[0])  # type: ignore[index]
        return f"first non-finite gradient in param group {group} ('{name}')"

    @property
    def grad_norm(self) -> Optional[float]:
        """Global gradient norm (unscaled, before clipping) of the last step, for logging."""
        norms = [e.grad_norm for e in self._engines.values() if e.grad_norm is not None]
        return float(sum(n * n for n in norms) ** 0.5) if norms else None

    @property
    def loss_scale(self) -> Optional[float]:
        return self.precision_plugin.loss_scale  # type: ignore[attr-defined]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank so far: fp16 overflows and non-finite steps (``nonfinite='skip'``)."""
        scaler = self.precision_plugin.scaler  # type: ignore[attr-defined]
        return (scaler.overflows if scaler is not None else 0) + self._nonfinite_skipped

    @property
    def engines(self) -> list[ZeroEngine]:
        return list(self._engines.values())

    # ------------------------------------------------------------------ collectives (both front ends' hooks)
    def barrier(self, name: Optional[str] = None) -> None:
        ids = [self.root_device.index] if self.root_device.type == "cuda" else None  # type: ignore[attr-defined]
        C.barrier(None, device_ids=ids)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return C.broadcast_object(obj, src, None)

    def _reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
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

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        n = C.world_size(group)
        t = tensor.contiguous()
        out = [torch.empty_like(t) for _ in range(n)]
        C.all_gather_list(out, t, group)
        return torch.stack(out)

    # ------------------------------------------------------------------ failure and teardown
    def _note_failure(self, exception: BaseException) -> None:
        """A failure on this rank: reported in full once across ranks (failures.py [Note: failing
        once]); teardown will release engines without collectives; an async checkpoint save still
        writing gets a bounded wait. Torch's error on a released ZeRO-3 parameter becomes one that
        says where and what to do."""
        self._end_watch()
        self._failed = True
        C.destroy_groups_at_exit(False)  # a peer may be gone: no destroy at exit ([Note: destroy at exit])
        hold_sigterm()  # the cleanup below and in teardown runs to its end
        if self._watchdog is not None:
            self._watchdog.own_failure = True
        if self._checkpointer is not None:
            self._checkpointer.wait_or_abandon(timeout_s=60.0)
        # Engines abandoned first (background steps joined, swap files removed; no collective), before the
        # report below, which may wait on the store for a second: Lightning's launcher SIGKILLs every
        # rank the moment a failed peer exits, and swap files must not outlive the job. Teardown repeats
        # it (idempotent).
        for engine in list(self._engines.values()):
            engine.abandon()
        if not isinstance(exception, KeyboardInterrupt):
            print_once(FailureBoard.for_default_group(exception), exception)  # the main thread's own store client
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

    def _remove_swap_dirs(self) -> None:
        """The watchdog's cleanup when a peer failed and this process is ended (no collective)."""
        for engine in list(self._engines.values()):
            swap = getattr(engine, "swap_dir", None)
            path = swap() if callable(swap) else None
            if path:
                shutil.rmtree(path, ignore_errors=True)

    def _teardown_engines(self) -> None:
        """Watchdog joined; engines finish (offload: a delayed step, swap files) and drop their hooks,
        or after a failure are abandoned without a collective. Engines stay: a save after training
        still gathers their shards; released stage-3 modules get a guard naming the fix."""
        self._end_watch()
        if self._watchdog is not None:  # joined: a daemon thread inside a store call at interpreter exit aborts it
            self._watchdog.stop()
            self._watchdog.join(timeout=5.0)
            self._watchdog = None
        C.destroy_groups_at_exit(not self._failed)  # comm/collectives.py [Note: destroy at exit]
        if self._failed:  # after an exception: no collective (a peer may be gone), threads joined, swap removed
            for engine in self._engines.values():
                engine.abandon()
            return
        self.wait_for_checkpoint()  # an async save still writing: training ends when it is on disk
        module = self._zero_module
        for engine in self._engines.values():
            engine.teardown()  # offload: finish a delayed step, release swap files
            engine.remove_hooks()
            if isinstance(engine, Stage3Engine) and module is not None:
                engine.end_eval_step()
                self._guards += guard_released_modules(module, engine)


class NonFiniteStepError(RuntimeError):
    """A non-finite gradient stopped the run (``nonfinite='error'``, or ``max_nonfinite_steps`` in a row)."""


def check_optimizers_own_their_params(optimizers: list[Optimizer], names: dict[int, str]) -> None:
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
                        "parameter: give every parameter to exactly one optimizer."
                    )


def frozen_params(module: torch.nn.Module, optimizers: list[Optimizer]) -> list[torch.nn.Parameter]:
    """Stage 3 partitions these too, without gradients, masters or optimizer state: parameters with
    ``requires_grad=False`` or in no optimizer (the frozen base of a LoRA fine-tune). Non-floating
    parameters stay replicated."""
    trainable = {id(p) for opt in optimizers for pg in opt.param_groups for p in pg["params"] if p.requires_grad}
    return [p for p in module.parameters() if id(p) not in trainable and p.is_floating_point()]
