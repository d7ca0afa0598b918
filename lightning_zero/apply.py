"""apply_zero: what setting a module up under ZeRO does, in order, in one place.

[Note: the order of apply_zero]
:func:`apply_zero` reads top to bottom as torchtitan's ``parallelize_llama`` does; each step needs the
one before it:

0. FP8: the chosen ``nn.Linear``s become torchao's ``Float8Linear`` (quant/fp8.py [Note: FP8 linears are
   torchao's]), keeping their Parameters, before anything (broadcast, optimizers, engines, units) reads them.
1. Tensor-parallel check: a module ``configure_model`` split over ``tp`` must be split consistently
   (parallel/validate.py), before anything is moved or broadcast.
2. Expert-parallel bind: MoE layers learn their expert group before the broadcast, which sends expert
   weights over the expert-data-parallel group only (moe/parallel.py).
3. Place and broadcast: the module on this rank's device (meta parameters stay meta) and every
   replica starts from rank 0's weights and buffers, as DDP does at wrap time; the state-dict dtypes
   are remembered here, before the cast, for the checkpoints.
4. The optimizers (Lightning's ``configure_optimizers`` runs here, on the placed module, as under ddp).
   Then the exact fp32 shares of frozen fp32 parameters, before stage 3 partitions them and step 7 rounds them
   (frozen_fp32.py [Note: frozen fp32 parameters under the cast layout]).
5. One engine per optimizer: stage and offload from the config; the fp32 masters are taken now, in fp32
   (stage 3 materialises a meta-built module unit by unit here, each unit costing memory once).
   Not fitting: the engines of an earlier fit, or under stage 3 with none, one engine over frozen
   partitions and no optimizer (inference/engine.py [Note: an engine without an optimizer]).
6. Materialise what no engine owns (not fitting below stage 3, or parameters outside every optimizer).
7. Cast: the rest of the module to the compute dtype (the masters exist already).
8. Compile: the one call site of ``torch.compile`` (zero/compile.py), after the cast, on stage 3's units.
9. Activation offload: the one call site (activations/policy.py), on the compiled or plain units.
10. Buffer sync: buffers follow rank 0's at every step (zero/buffers.py), built last, on cast buffers.

Fabric may set a module up before its optimizers exist (fabric/strategy.py [Note: set up without an
optimizer]): it calls the three phases :func:`prepare_module` (0-3), :func:`build_engines` (5) and
:func:`finish_setup` (6-10) itself, in the same order, at the times its API allows.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_zero.activations.policy import apply_activation_offload
from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed import protocol as compressed_comm
from lightning_zero.config import (
    Fp8Config, OffloadConfig, QuantCommConfig, SequenceConfig, Stage3Config, StatePrecisionConfig,
)
from lightning_zero.engines import (Engines, check_fp32_params, check_optimizers_own_their_params, check_real_params,
                                    check_supported_layers, rounded_params)
from lightning_zero.frozen_fp32 import FrozenFp32, fits_on_host
from lightning_zero.inference.engine import build_inference_engine
from lightning_zero.moe.parallel import bind_expert_parallel
from lightning_zero.offload.engines import offload_engine
from lightning_zero.offload.settings import OffloadHost
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.parallel.validate import check_tensor_parallel
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.precision import ZeroPrecision, dtype_name
from lightning_zero.quant import fp8
from lightning_zero.sequence.apply import tile_module_mlps
from lightning_zero.zero.buffers import BufferSync
from lightning_zero.zero.compile import compile_for_strategy
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.materialize import has_meta_params, make_unit_materializer, materialize_modules
from lightning_zero.zero.released_guard import guard_state_dicts, refuse_released_elsewhere
from lightning_zero.zero.shard_comm import ShardComm, is_expert
from lightning_zero.zero.stage1 import Stage1Engine
from lightning_zero.zero.stage2 import Stage2Engine
from lightning_zero.zero.stage3 import Stage3Engine
from lightning_zero.zero.zeropp import HpzGroups

ENGINES: dict[int, type[ZeroEngine]] = {0: ZeroEngine, 1: Stage1Engine, 2: Stage2Engine, 3: Stage3Engine}


def apply_zero(
    module: torch.nn.Module,
    optimizers: Optional[Callable[[], list[Optimizer]]],
    engines: Engines,
    *,
    dims: ParallelDims,
    device: torch.device,
    precision: ZeroPrecision,
    host: OffloadHost,
) -> Engines:
    """Set ``module`` up under ZeRO ([Note: the order of apply_zero]); returns ``engines``, filled.

    ``optimizers``: called once the module is placed (Lightning's ``configure_optimizers``); None when
    not fitting: the engines of the previous fit are kept and their forward hooks put back on.
    ``host``: where this rank runs (ranks per node, global rank) and whether the loop accumulates
    gradients over several backwards (offload's host-memory and disk checks)."""
    prepare_module(engines, module, dims, device)  # 1-3
    if optimizers is not None:
        engines.unshard_to_plain()  # a second fit: stage-3 parameters get their full storage back
        opts = optimizers()
        engines.rounded_start = rounded_params(opts, {id(p): n for n, p in module.named_parameters()},
                                               engines.orig_dtypes)  # refused at the first step unless loaded over
        keep_frozen_fp32(engines, module, opts, dims, precision, host.ranks_per_node)  # 4a
        build_engines(engines, module, opts, dims=dims, device=device, precision=precision, host=host)  # 4-5
    elif not build_inference_engine(engines, module, device=device, compute_dtype=precision.compute_dtype,
                                    global_rank=host.global_rank):  # stage 3 evaluating, no fit: ZeRO-Inference
        engines.install_module_hooks()  # validate/test/predict after fit: gather per unit again
    finish_setup(engines, module, device, precision)  # 6-10
    return engines


def prepare_module(engines: Engines, module: torch.nn.Module, dims: ParallelDims, device: torch.device) -> None:
    """Steps 0-3: fp8's Linears converted (when asked); the module on this rank's device (meta parameters
    stay meta: materialised later, unit by unit) with rank 0's weights and buffers; remembers the dtypes the
    checkpoints restore."""
    fp8.convert(module, engines.config.piece(Fp8Config), device, str(engines.precision.precision))  # 0
    if engines.config.sequence_parallel == 1:  # with SP, sequence/apply.py tiled them with the attention
        tile_module_mlps(module, engines.config.piece(SequenceConfig))
    if dims.tp > 1:
        check_tensor_parallel(module, dims.tp)
    bind_expert_parallel(module, engines.config.expert_parallel, dims.ep_group)  # before the broadcast
    place(module, device)
    broadcast_module_states(module, dims)
    if engines.module is not module:
        refuse_released_elsewhere(module)
    again = engines.module is module and bool(engines.orig_dtypes)  # a second fit: its dtypes are the cast's
    engines.module = module
    engines.dims = dims
    engines.remove_guards()
    if not again:
        engines.orig_dtypes = {k: v.dtype for k, v in module.state_dict(keep_vars=True).items() if torch.is_tensor(v)}
        engines.orig_buffer_dtypes = {k: b.dtype for k, b in module.named_buffers()}


def place(module: torch.nn.Module, device: torch.device) -> None:
    """``module`` on ``device``; meta tensors stay meta (materialised later, unit by unit)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def broadcast_module_states(module: torch.nn.Module, dims: Optional[ParallelDims]) -> None:
    """Make every replica start from rank 0's weights and buffers (as DDP does at wrap time)."""
    if C.world_size() == 1:
        return
    group = dims.dp_group if dims is not None else None
    expert_group = dims.edp_group if dims is not None and dims.ep > 1 else group
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            src_group = expert_group if is_expert(t) else group  # the replicas of the same experts only
            # meta parameters are materialised identically on every rank; released ZeRO-3 ones are
            # consistent already (their shards are)
            t = local_tensor(t)  # a DTensor's TP shard: the dp ranks of one tp rank hold the same one
            if not t.is_meta and t.untyped_storage().nbytes() > 0:
                C.broadcast(t.data, 0, src_group)


def build_engines(engines: Engines, module: torch.nn.Module, optimizers: list[Optimizer], *, dims: ParallelDims,
                  device: torch.device, precision: ZeroPrecision, host: OffloadHost,
                  only: Optional[list[Optimizer]] = None) -> None:
    """Step 5: one engine per optimizer (stage and offload from the config). ``host``: see
    :func:`apply_zero` (offload's host-memory check counts an accumulator). ``only``: add engines for these optimizers, keeping the existing ones (Fabric's
    ``setup_optimizers`` after ``setup_module``, stages 0-2); by default every engine is new."""
    config = engines.config
    engine_cls = ENGINES[config.stage]
    stage_options: dict[str, Any] = {}
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    check_optimizers_own_their_params(optimizers, names)
    check_real_params(optimizers, names)
    check_fp32_params(optimizers, names, engines.orig_dtypes)
    check_supported_layers(module)
    if config.stage == 3:
        stage_options = {
            "module": module,
            "param_group": dims.dp_param_group,
            "stage3": config.piece(Stage3Config),
            "materialize": make_unit_materializer(module, device, getattr(module, "zero_init_module", None)),
            "quant_comm": config.piece(QuantCommConfig),
            "hpz": HpzGroups(dims.hpz_param_group, dims.hpz_grad_group, dims.hpz_cross_group) if dims.hierarchical else None,
        }
    if config.offloads:  # ZeRO-Offload / ZeRO-Infinity: the stage's engine with offload mixed in
        engine_cls = offload_engine(config.stage)
        stage_options["offload"] = config.piece(OffloadConfig)
        stage_options["offload_host"] = host
    if config.state_precision != "fp32":  # 16-bit device states (zero/states16.py)
        stage_options["states"] = config.piece(StatePrecisionConfig)
    dtype = precision.compute_dtype
    bucket_numel = max(1, int(config.bucket_size_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
    norm_groups = [dims.pp_group] if dims.pp > 1 else []
    frozen = frozen_params(module, optimizers) if config.stage == 3 else []
    if only is None:
        engines.by_optimizer = {}
    experts = ShardComm.over(dims.edp_group, dims.edp_param_group) if dims.ep > 1 else None
    for i, opt in enumerate(optimizers if only is None else only):
        if experts is not None and compressed_comm.uses_compressed_comm(opt):
            raise NotImplementedError(f"{type(opt).__name__} with expert_parallel > 1 is not built yet.")
        compressed_comm.attach_backend(opt, config.stage, dims.dp_group)  # 1-bit optimizers only
        options: dict[str, Any] = dict(stage_options)
        if dims.tp > 1:
            options["tp_group"] = dims.tp_group
        if experts is not None:
            options["expert_comm"] = experts
        if i == 0 and frozen:  # the first engine partitions the frozen parameters (stage3.py [Note: frozen parameters])
            options["frozen_params"] = frozen
        engines.by_optimizer[id(opt)] = engine_cls(
            opt, dims.dp_group, dtype, device, bucket_numel, norm_groups=norm_groups, param_names=names, **options
        )


def keep_frozen_fp32(engines: Engines, module: torch.nn.Module, optimizers: list[Optimizer], dims: ParallelDims,
                     precision: ZeroPrecision, ranks_per_node: int) -> None:
    """Step 4a, frozen_fp32.py [Note: frozen fp32 parameters under the cast layout]: this rank's exact fp32 share
    of every frozen fp32 parameter, taken after rank 0's broadcast and before stage 3 partitions them or the cast
    layout rounds them; the share is the one checkpoints write (the expert-data-parallel ranks' for an expert's)."""
    if not precision.is_mixed:  # 32-true or autocast: the module stays fp32
        engines.frozen_fp32 = None
        return

    def share_of(p: torch.Tensor) -> tuple[int, int, Optional[C.ProcessGroup]]:
        if dims.ep > 1 and is_expert(p):
            return dims.edp_rank, dims.edp, dims.edp_group
        return dims.dp_rank, dims.dp, dims.dp_group

    frozen = frozen_params(module, optimizers)
    if not fits_on_host(frozen, dims.dp, ranks_per_node):  # warn_frozen_rounding names them
        engines.frozen_fp32 = None
        return
    engines.frozen_fp32 = FrozenFp32.capture(frozen, share_of, engines.frozen_fp32)


def warn_frozen_rounding(engines: Engines, module: torch.nn.Module, precision: ZeroPrecision) -> None:
    """One warning when the cast layout is about to round frozen fp32 parameters to 16 bits for good: those
    :func:`keep_frozen_fp32` kept no exact share of (built on the meta device, set up before any optimizer
    existed: Fabric's ``setup_module``, or too large for the host's free memory). Their 16-bit copy is all that is
    left of them, so the module after fit, ``full_state_dict()`` and checkpoints hold them rounded, where ddp's
    ``bf16-mixed`` keeps them as built; ``mixed_precision='autocast'`` keeps the module fp32."""
    managed = {id(p) for engine in engines for fg in engine.groups for p in fg.params}
    if not precision.is_mixed or not managed:  # 32-true, autocast, or no training (predict)
        return
    kept = engines.frozen_fp32
    frozen = [n for n, p in module.named_parameters()
              if id(p) not in managed and engines.orig_dtypes.get(n, p.dtype) == torch.float32
              and not (kept is not None and kept.holds(p))]
    if frozen:
        shown = ", ".join(repr(n) for n in frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
        dtype = dtype_name(precision.compute_dtype)
        rank_zero_warn(f"lightning_zero: {len(frozen)} frozen fp32 parameters ({shown}) are cast to {dtype} under "
                       f"precision='{precision.precision}' (mixed_precision='cast') with no exact fp32 copy kept "
                       "(built on the meta device, set up before any optimizer, or their copies would not fit in "
                       "host memory): the module after fit, full_state_dict() and checkpoints hold them rounded to "
                       f"{dtype}, where ddp keeps them fp32. ZeroStrategy(mixed_precision='autocast') keeps them.")


def finish_setup(engines: Engines, module: torch.nn.Module, device: torch.device, precision: ZeroPrecision) -> None:
    """Steps 6-10, after the engines exist: meta parameters outside every engine materialised, the module
    cast to the compute dtype (the fp32 masters were taken before), compile and activation offload
    applied at their one call site each, buffers followed from rank 0."""
    config = engines.config
    if has_meta_params(module):  # not fitting, or parameters outside every optimizer
        materialize_modules(list(module.modules()), device)
    warn_frozen_rounding(engines, module, precision)
    precision.cast_module(module)
    if config.stage == 3:  # state_dict()/load_state_dict() of released modules refuse: zero/released_guard.py
        engines.guards += guard_state_dicts(module)
    engines.compile_plan = compile_for_strategy(module, engines.inner_units(), config)  # the one call site of torch.compile
    if config.activation_offload:  # the one call site: activations/policy.py [Note: the strategy option]
        apply_activation_offload(module, config.activation_offload_policy, engines.unit_modules(),
                                 device_fraction=config.activation_offload_device_fraction)
    for engine in engines:
        for fg in engine.groups:
            for p in fg.params:
                if p.dtype != fg.compute_dtype:  # pragma: no cover - guards the view invariant
                    raise RuntimeError("A ZeRO-managed parameter lost its flat-buffer view.")
    dims = engines.dims
    engines.buffer_sync = BufferSync(module, dims.dp_group if dims is not None else None,
                                     dims.dp_host_group if dims is not None else None)
    engines.watched = set()


def frozen_params(module: torch.nn.Module, optimizers: list[Optimizer]) -> list[torch.nn.Parameter]:
    """Stage 3 partitions these too, without gradients, masters or optimizer state: parameters with
    ``requires_grad=False`` or in no optimizer (the frozen base of a LoRA fine-tune). Non-floating
    parameters stay replicated."""
    trainable = {id(p) for opt in optimizers for pg in opt.param_groups for p in pg["params"] if p.requires_grad}
    return [p for p in module.parameters() if id(p) not in trainable and p.is_floating_point()]
