"""Typed configuration of ZeroStrategy: the one place where its defaults are written.

Hydra's ``conf/strategy/*.yaml`` files, the registered strategy names and the
``ZeroStrategy`` constructor all read their defaults from :class:`ZeroConfig`;
nothing else restates them (DeepSpeed writes its defaults in three places, and they drift).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

VALID_STAGES = (0, 1, 2, 3)
VALID_SCHEDULES = ("1f1b", "gpipe", "interleaved")
VALID_OFFLOAD = ("none", "cpu", "nvme")
VALID_CHECKPOINT_FORMATS = ("sharded", "full")
VALID_NONFINITE = ("skip", "error", "ignore")
COMPILE_ARGS = frozenset({"backend", "mode", "fullgraph", "dynamic", "options", "disable"})
"""Keyword arguments of ``torch.compile`` that ``compile_options`` may set."""


@dataclass
class ZeroConfig:
    """What a ZeRO strategy does; every field has a sensible default."""

    stage: int = 2
    """ZeRO stage: 0 data parallel, 1 partitioned optimizer states, 2 also gradients, 3 also parameters."""

    bucket_size_mb: float = 50.0
    """Size cap of one gradient communication bucket, in MiB of 16-bit (or fp32) gradients.
    Larger buckets mean fewer, more efficient collectives; smaller ones start overlapping earlier."""

    overlap_comm: bool = True
    """Run gradient collectives on a side CUDA stream while backward continues (no effect on CPU,
    where gloo collectives are asynchronous already)."""

    unit_policy: Optional[list[str]] = None
    """Stage 3: which module subtrees are gathered as one unit. None: repeated blocks found through
    ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential`` (transformer blocks, timm/torchvision stages;
    lightning_zero/zero/units.py [Note: what a unit is]); else class names or fnmatch patterns of module
    names, e.g. ``["Block"]``. Parameters read outside their unit's forward are found in the first step
    and kept gathered for whole steps."""

    prefetch_units: int = 1
    """Stage 3: how many units ahead (in the recorded execution order) to all-gather while one computes."""

    max_live_parameters: int = 1_000_000_000
    """Stage 3: prefetching stops while more than this many parameters are gathered at once."""

    param_persistence_threshold: int = 100_000
    """Stage 3: units with at most this many parameters stay gathered (their all-gathers cost more
    latency than their memory is worth)."""

    offload_optimizer: str = "none"
    """ZeRO-Offload (stages 1-3): where the fp32 master weights and optimizer states live. 'none' (the
    device), 'cpu' (pinned host memory; the step runs on the CPU, with the compiled CPU Adam for
    Adam/AdamW) or 'nvme' (files under ``nvme_path``, swapped through host buffers chunk by chunk).
    Costs PCIe traffic (gradients down, 16-bit parameters up) and CPU time; saves 12-14 bytes per
    parameter of device memory. ``python -m lightning_zero.estimate`` shows the trade for a model."""

    offload_params: str = "none"
    """ZeRO-Infinity (stage 3 only, with ``offload_optimizer``): where the 16-bit parameter partitions
    live between uses: 'none' (the device), 'cpu' (pinned host memory) or 'nvme' (one file per unit
    and rank). They are copied to the device unit by unit, with the same prefetch as the gathers."""

    nvme_path: Optional[str] = None
    """Directory for 'nvme' offload (a fast local disk; not tmpfs, which is RAM); no default (the
    ``zero3_offload_nvme`` preset refuses without one). It must exist and be writable (checked here,
    when the config is built, before any process starts) and have room for the swap files (checked at
    setup, once the model's size is known). Swap files go to a
    ``lightning_zero_swap`` subdirectory and are removed at teardown; never point it at checkpoints."""

    pin_memory: bool = True
    """Offload: page-lock the host buffers, so device<->host copies are asynchronous and ~7x faster.
    Pinned memory cannot be swapped by the OS; turn off when the host is short of RAM."""

    nvme_chunk_mb: float = 256.0
    """'nvme' optimizer offload: MiB of fp32 master per swap chunk. Three chunks' buffers (master and
    optimizer states) are in host memory at once: one being read, one stepped, one written."""

    nvme_io_threads: int = 4
    """'nvme' offload: threads doing the direct (O_DIRECT) reads and writes and their checksums."""

    nvme_fraction: float = 1.0
    """'nvme' optimizer offload: the fraction of the masters and optimizer states (whole chunks) kept on
    NVMe; the rest stays in host memory and is stepped without I/O. Below 1 when the disk is smaller
    than the states, or to trade host memory for less disk traffic."""

    offload_ratio: Any = 1.0
    """Optimizer offload: the fraction of this rank's optimizer partition (fp32 masters and Adam moments)
    kept in host memory and stepped by the CPU; the rest stays on the device and is stepped there by a
    fused Adam, after backward (DeepSpeed's partial offload "ratio"). 1.0: everything on the host (plain
    ZeRO-Offload); 0.0: nothing (offload_optimizer then only changes where checkpoints stage). A float in
    [0, 1], or 'auto': the first step runs fully offloaded, then the largest device-resident share that
    fits the device's free memory (measured peak of that step, 10% headroom) moves to the device. The
    host share is the partition's *first* buckets (the last layers: their gradients land first, so the
    CPU step overlaps the rest of backward longest). Adam/AdamW only; not with delayed_param_update.
    See lightning_zero/offload/device_share.py."""

    offload_state_precision: str = "fp32"
    """CPU optimizer offload: the layout of the host masters and Adam moments (issue #15;
    lightning_zero/optim/host_states.py [Note: host state precisions]). 'fp32' (12 bytes per parameter,
    torch's Adam exactly), 'bf16_sr' (6: bf16 master and moments, stochastic rounding), 'bf16_kahan'
    (8: bf16 master with a bf16 Kahan compensation word, bf16 moments), 'int8' (~6: fp32 master, 8-bit
    blockwise moments). The compact layouts halve the host memory of the optimizer (what decides the
    largest model a host can train), not the step time, and change the algorithm slightly (all train the
    example GPT to within 1% of fp32 Adam in 300 steps). Checkpoints hold torch's fp32 layout either way.
    Adam/AdamW, offload_optimizer='cpu' and offload_ratio=1 only."""

    delayed_param_update: bool = False
    """Offload: the ZeRO-Offload paper's one-step delayed parameter update. The CPU step of step t runs
    while the device computes step t+1, which therefore uses parameters one update old. Hides the CPU
    step almost entirely; the price is staleness: the paper reports unchanged convergence after a few
    dozen synchronous warm-up steps, but it is a change of the algorithm (results differ from the
    synchronous run and from ddp; validation sees parameters one step old). Off by default."""

    delayed_param_update_warmup: int = 10
    """With ``delayed_param_update``: synchronous steps before the delay starts (early training moves
    fastest, where staleness hurts most)."""

    offload_step_in_backward: bool = True
    """'cpu' optimizer offload: run the CPU Adam step range by range while backward still runs, as each
    bucket's reduced gradient lands in host memory. Same results as stepping after backward; used only
    for steps that need no global view of the gradients first (no clipping, no fp16 loss scaling, no
    gradient accumulation, ``nonfinite='ignore'``, Adam/AdamW; see lightning_zero/offload/eager.py),
    otherwise the step runs after backward as usual. False: always after backward."""

    nonfinite: str = "skip"
    """What a step whose global gradient norm is NaN or infinite does, at every stage and precision
    (lightning_zero/zero/engine.py [Note: non-finite steps]). 'skip': the step is skipped on every rank
    (weights and optimizer state untouched, the gradients dropped), one warning names the step and the
    first parameter group holding a non-finite gradient, ``train/skipped_steps`` counts it, and
    ``max_nonfinite_steps`` skips in a row stop the run with an error. 'error': the first one stops the
    run. 'ignore': the optimizer steps anyway (torch's and ddp's behaviour: NaN weights from then on).
    fp16 (``16-mixed``): an overflow the loss scale can still absorb is skipped as always (the scale is
    lowered); this setting judges overflows at the minimum scale. The check reads the norm the step
    computes anyway: one host synchronisation per step (fp16 and gradient clipping read it already), and
    with CPU optimizer offload 'skip' and 'error' turn off ``offload_step_in_backward`` (an update made
    during backward cannot be taken back); 'ignore' restores both."""

    max_nonfinite_steps: int = 8
    """With ``nonfinite='skip'``: this many non-finite steps in a row stop the run (a diverged run, or
    NaN in the data, would otherwise skip forever)."""

    checkpoint_format: str = "sharded"
    """How Lightning's checkpoints are written. 'sharded': a directory at the checkpoint's path, written
    through torch.distributed.checkpoint by every rank, each writing only the partitions it owns (no
    gather; resumable under any stage and world size; ``python -m lightning_zero.checkpoint consolidate``
    makes one plain file of it). 'full': one ordinary file with the full fp32 weights and optimizer
    state, gathered onto every rank first (needs the whole model to fit; readable by plain torch).
    Loading accepts either, whatever this says."""

    checkpoint_async: bool = False
    """Sharded checkpoints: copy this rank's partitions into host memory and write them in a background
    thread while training goes on (torch.distributed.checkpoint's async save, over a separate gloo
    group). The next save, the end of fit and an exception wait for it; costs one host copy of the
    rank's partitions."""

    checkpoint_threads: int = 4
    """Sharded checkpoints: files (and writer threads) per rank; reads use as many threads."""

    checkpoint_fsync: bool = True
    """Sharded checkpoints: fsync every file before the directory is renamed into place, so a finished
    checkpoint also survives a machine crash (a killed process never leaves a half-written one either way)."""

    activation_offload: bool = False
    """ZeRO-R activation memory: checkpoint every stage-3 unit (below stage 3 and under pipeline stages:
    the repeated blocks units.py's default policy finds) with its checkpoint, the unit's input, kept in
    pinned host memory, copied out on a side stream and brought back ahead of the recomputation
    (lightning_zero/activations/policy.py [Note: the strategy option]). Saves one ``batch x seq x
    d_model`` tensor of device memory per unit for a full recomputation of each unit in backward and
    two PCIe copies. Leave the model's own activation checkpointing off when this is on."""

    activation_offload_policy: Optional[list[str]] = None
    """With ``activation_offload``: which modules are checkpointed, as class names or fnmatch patterns
    of module names (like ``unit_policy``); None takes the stage-3 units (or the repeated blocks)."""

    compile: bool = False
    """torch.compile each unit one by one (stage 3's units; below stage 3 the repeated blocks the same
    policy finds), with ZeRO-3's gather/release hooks outside the compiled regions, as FSDP2 does with
    per-block compile (lightning_zero/zero/compile.py). Without it, a network the user compiled
    still works under every stage; under stage 3 the user's whole-network compile is moved onto the
    units ([Note: the user's compile under stage 3]). The first batch of each kind runs eagerly under stage 3."""

    compile_options: Optional[dict[str, Any]] = None
    """With ``compile``: keyword arguments of ``torch.compile`` (``backend``, ``mode``, ``fullgraph``,
    ``dynamic``, ``options``); None uses torch's defaults (inductor)."""

    pipeline_stages: int = 1
    """Pipeline-parallel degree; world size = data-parallel degree x pipeline_stages x tensor_parallel."""

    tensor_parallel: int = 1
    """Tensor-parallel degree: each layer's weights are split over this many ranks (contiguous ranks, one
    host), by torch's own tools: ``configure_model`` calls ``parallelize_module(module,
    self.device_mesh["tp"], plan)`` (ready plans in :mod:`lightning_zero.parallel`). ZeRO then partitions
    each rank's TP shard over the data-parallel ranks; world size = data-parallel degree x
    pipeline_stages x tensor_parallel (lightning_zero/parallel_dims.py). Stages 0-3; with pipeline_stages
    (stages 0-1) each stage's layers are parallelized over the tp sub-mesh of its pp rank
    (lightning_zero/parallel/stage.py [Note: TP plans per pipeline stage]); with CPU and NVMe offload
    (stages 1-3), on each rank's local TP shard."""

    expert_parallel: int = 1
    """Mixture of Experts (issue #20): experts of every :class:`lightning_zero.moe.MoE` layer are split
    over groups of this many data-parallel ranks (contiguous ranks), tokens exchanged by all-to-all inside
    a group. Non-expert parameters stay data parallel over every rank; expert parameters are reduced and
    partitioned by the ZeRO stage over the ranks holding the same experts (data-parallel degree /
    expert_parallel of them). Must divide the world size and each MoE layer's ``num_experts``; the
    strategy hands its group to the layers at setup (lightning_zero/moe/parallel.py [Note: who tells a
    layer its group]). Stages 0-3; not yet with pipeline_stages, tensor_parallel, offload, 1-bit
    optimizers or checkpoints."""

    microbatches: int = 4
    """Pipeline only: each batch is cut into this many equal micro-batches that flow through the stages
    one after another. More shrink the idle bubble (P-1)/(M+P-1) but make each matmul smaller; the
    per-rank training batch size must be a multiple of it."""

    schedule: str = "1f1b"
    """Pipeline only: '1f1b' (one forward one backward: at most P - s micro-batches of activations live on
    stage s), 'gpipe' (all forwards, then all backwards: M live, same bubble) or 'interleaved'
    (Megatron's interleaved 1F1B over ``virtual_stages`` model chunks per rank: bubble (P-1)/(V M+P-1)
    when a backward costs about two forwards, for V times the messages; microbatches must be a
    multiple of pipeline_stages)."""

    virtual_stages: int = 2
    """Pipeline with schedule='interleaved' only: model chunks per rank (Megatron's virtual pipeline size);
    the layers are split into pipeline_stages x virtual_stages parts."""

    process_group_backend: Optional[str] = None
    """torch.distributed backend; None picks nccl on CUDA and gloo on CPU."""

    timeout_s: float = 1800.0
    """Collective timeout of the process groups, in seconds."""

    start_method: str = "popen"
    """How Lightning starts extra local processes: 'popen' re-runs the script (like ddp), 'spawn'/'fork'
    use multiprocessing. Ignored under torchrun/SLURM, which start the processes themselves."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject bad values before any process group exists, naming the valid choices."""
        if self.stage not in VALID_STAGES:
            raise ValueError(f"ZeRO stage must be one of {list(VALID_STAGES)}, got {self.stage!r}.")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb!r}.")
        if self.prefetch_units < 0 or self.max_live_parameters < 1 or self.param_persistence_threshold < 0:
            raise ValueError(
                "prefetch_units >= 0, max_live_parameters >= 1 and param_persistence_threshold >= 0 are required, "
                f"got {self.prefetch_units}, {self.max_live_parameters}, {self.param_persistence_threshold}."
            )
        if self.unit_policy is not None and (
            isinstance(self.unit_policy, str) or not all(isinstance(x, str) for x in self.unit_policy)
        ):
            raise ValueError(f"unit_policy must be a list of class names or module-name patterns, got {self.unit_policy!r}.")
        if self.activation_offload_policy is not None and (
            isinstance(self.activation_offload_policy, str)
            or not all(isinstance(x, str) for x in self.activation_offload_policy)
        ):
            raise ValueError(
                "activation_offload_policy must be a list of class names or module-name patterns, "
                f"got {self.activation_offload_policy!r}."
            )
        if not (isinstance(self.pipeline_stages, int) and self.pipeline_stages >= 1):
            raise ValueError(f"pipeline_stages must be an integer >= 1, got {self.pipeline_stages!r}.")
        self._validate_pipeline()
        self._validate_tensor_parallel()
        self._validate_expert_parallel()
        self._validate_offload()
        self._validate_compile()
        if self.process_group_backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"process_group_backend must be one of [None, 'nccl', 'gloo'], got {self.process_group_backend!r}."
            )
        if self.checkpoint_format not in VALID_CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format must be one of {list(VALID_CHECKPOINT_FORMATS)}, got {self.checkpoint_format!r}."
            )
        if not (isinstance(self.checkpoint_threads, int) and self.checkpoint_threads >= 1):
            raise ValueError(f"checkpoint_threads must be an integer >= 1, got {self.checkpoint_threads!r}.")
        if self.checkpoint_async and self.checkpoint_format != "sharded":
            raise ValueError("checkpoint_async=True needs checkpoint_format='sharded'.")
        if self.nonfinite not in VALID_NONFINITE:
            raise ValueError(f"nonfinite must be one of {list(VALID_NONFINITE)}, got {self.nonfinite!r}.")
        m = self.max_nonfinite_steps
        if isinstance(m, bool) or not (isinstance(m, int) and m >= 1):
            raise ValueError(f"max_nonfinite_steps must be an integer >= 1, got {m!r}.")
        if self.start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be one of ['popen', 'spawn', 'fork', 'forkserver'], got {self.start_method!r}."
            )

    def _validate_compile(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}.")
        if self.compile_options is not None:
            if not isinstance(self.compile_options, dict):
                raise ValueError(f"compile_options must be a dict of torch.compile arguments, got {self.compile_options!r}.")
            bad = sorted(set(self.compile_options) - COMPILE_ARGS)
            if bad:
                raise ValueError(f"compile_options has unknown torch.compile argument(s) {bad}; valid: {sorted(COMPILE_ARGS)}.")
            if not self.compile:
                raise ValueError("compile_options is set but compile is False: set compile=True too.")

    def _validate_tensor_parallel(self) -> None:
        """tensor_parallel must be an integer >= 1 (what it cannot combine with is refused where that is
        checked: expert_parallel below, pipeline stages' ZeRO stage in the pipeline checks)."""
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not (isinstance(tp, int) and tp >= 1):
            raise ValueError(f"tensor_parallel must be an integer >= 1, got {tp!r}.")

    def _validate_expert_parallel(self) -> None:
        """What expert parallelism is not built with yet fails here, saying so (issue #20)."""
        ep = self.expert_parallel
        if isinstance(ep, bool) or not (isinstance(ep, int) and ep >= 1):
            raise ValueError(f"expert_parallel must be an integer >= 1, got {ep!r}.")
        if ep == 1:
            return
        for name, value in (("pipeline_stages", self.pipeline_stages), ("tensor_parallel", self.tensor_parallel)):
            if value > 1:
                raise ValueError(f"expert_parallel={ep} with {name}={value} is not built yet.")
        if self.offloads:
            raise ValueError(f"expert_parallel={ep} with offload_optimizer/offload_params is not built yet.")

    def _validate_pipeline(self) -> None:
        if not (isinstance(self.microbatches, int) and self.microbatches >= 1):
            raise ValueError(f"microbatches must be an integer >= 1, got {self.microbatches!r}.")
        if self.schedule not in VALID_SCHEDULES:
            raise ValueError(f"schedule must be one of {list(VALID_SCHEDULES)}, got {self.schedule!r}.")
        if not (isinstance(self.virtual_stages, int) and self.virtual_stages >= 1):
            raise ValueError(f"virtual_stages must be an integer >= 1, got {self.virtual_stages!r}.")
        if self.pipeline_stages > 1 and self.stage >= 2:
            raise ValueError(
                f"ZeRO stage {self.stage} cannot be combined with pipeline_stages={self.pipeline_stages}: stage 2/3 "
                "reduce gradients in every backward, and a pipeline runs one backward per micro-batch. Use stage=0 or "
                "stage=1 (which partitions optimizer states within each stage's data-parallel group), as DeepSpeed does."
            )
        if self.pipeline_stages > 1 and self.schedule == "interleaved" and self.microbatches % self.pipeline_stages:
            raise ValueError(
                f"schedule='interleaved' needs microbatches ({self.microbatches}) to be a multiple of pipeline_stages "
                f"({self.pipeline_stages})."
            )

    def _validate_offload(self) -> None:
        """Offload settings that cannot work together fail here, at construction, and so does an
        ``nvme_path`` that does not exist or takes no file (its free space against the swap files' size
        is checked at setup, once the model's size is known)."""
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in VALID_OFFLOAD:
                raise ValueError(f"{name} must be one of {list(VALID_OFFLOAD)}, got {getattr(self, name)!r}.")
        if self.offload_params != "none" and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs stage=3 (only ZeRO stage 3 partitions the "
                f"parameters), got stage={self.stage}. Use stage=3, or offload_optimizer alone with stages 1-2."
            )
        if self.offload_params != "none" and self.offload_optimizer == "none":
            raise ValueError(
                f"offload_params={self.offload_params!r} with offload_optimizer='none' would keep the 12-byte "
                "fp32 masters and optimizer states on the device while moving the 2-byte parameters off it: "
                "set offload_optimizer='cpu' (or 'nvme') too."
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(
                f"offload_optimizer={self.offload_optimizer!r} needs stage >= 1 (the CPU steps this rank's "
                "partition; stage 0 has none). Use stage=1, 2 or 3."
            )
        if self.offload_optimizer != "none" and self.pipeline_stages > 1:
            raise ValueError("offload_optimizer with pipeline_stages > 1 is not supported yet.")
        if "nvme" in (self.offload_optimizer, self.offload_params):
            if not self.nvme_path:  # no default: a path that exists on every machine is not a fast local disk
                raise ValueError(
                    "offload to 'nvme' needs nvme_path: an existing directory on a fast local disk (not tmpfs), e.g. "
                    "ZeroStrategy(stage=3, offload_optimizer='nvme', offload_params='nvme', nvme_path='/mnt/nvme'), "
                    "or strategy.nvme_path=/mnt/nvme on the command line of examples/train.py."
                )
            from lightning_zero.offload.nvme import check_nvme_dir  # (offload imports config: imported here)

            check_nvme_dir(self.nvme_path)  # exists, writable, disk not full: before any process starts
        if not self.nvme_chunk_mb > 0 or not (isinstance(self.nvme_io_threads, int) and self.nvme_io_threads >= 1):
            raise ValueError(
                f"nvme_chunk_mb must be > 0 and nvme_io_threads an integer >= 1, got {self.nvme_chunk_mb!r}, "
                f"{self.nvme_io_threads!r}."
            )
        if not 0.0 < self.nvme_fraction <= 1.0:
            raise ValueError(f"nvme_fraction must be in (0, 1], got {self.nvme_fraction!r}.")
        if self.delayed_param_update and self.offload_optimizer == "none":
            raise ValueError("delayed_param_update needs offload_optimizer='cpu' or 'nvme' (it overlaps the CPU step).")
        self._validate_offload_ratio()
        self._validate_state_precision()
        if self.delayed_param_update_warmup < 0:
            raise ValueError(f"delayed_param_update_warmup must be >= 0, got {self.delayed_param_update_warmup!r}.")

    def _validate_state_precision(self) -> None:
        valid = ("fp32", "bf16_sr", "bf16_kahan", "int8")
        if self.offload_state_precision not in valid:
            raise ValueError(f"offload_state_precision must be one of {list(valid)}, got {self.offload_state_precision!r}.")
        if self.offload_state_precision != "fp32" and (self.offload_optimizer != "cpu" or self.offload_ratio != 1.0):
            raise ValueError(
                f"offload_state_precision={self.offload_state_precision!r} needs offload_optimizer='cpu' and "
                f"offload_ratio=1 (got {self.offload_optimizer!r}, {self.offload_ratio!r}): the compact layouts live "
                "in host memory and are stepped by the CPU."
            )

    def _validate_offload_ratio(self) -> None:
        r = self.offload_ratio
        if isinstance(r, str) and r != "auto":
            try:
                r = self.offload_ratio = float(r)  # Hydra hands command-line numbers of an Any field as they came
            except ValueError:
                raise ValueError(f"offload_ratio must be a number in [0, 1] or 'auto', got {r!r}.") from None
        if r == "auto":
            pass
        elif isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= float(r) <= 1.0:
            raise ValueError(f"offload_ratio must be a number in [0, 1] or 'auto', got {r!r}.")
        else:
            self.offload_ratio = float(r)
        if r == 1.0:
            return
        if self.offload_optimizer == "none":
            raise ValueError(
                f"offload_ratio={r!r} needs offload_optimizer='cpu' or 'nvme': it splits the offloaded optimizer "
                "partition between host and device."
            )
        if self.delayed_param_update:
            raise ValueError(
                f"offload_ratio={r!r} with delayed_param_update=True: the device share would step synchronously and "
                "the host share one step late. Use one or the other."
            )

    @property
    def offloads(self) -> bool:
        """Whether any state leaves the device (selects the offloading engines)."""
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ZeroConfig":
        """Build from keyword arguments, failing on unknown names with the list of valid ones
        (DeepSpeed silently drops constructor arguments when a config dict is passed: never here)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown ZeroStrategy option(s) {unknown}; valid options are {sorted(names)}.")
        return cls(**kwargs)


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for ``16-mixed`` (fp16 has too little range for raw gradients)."""

    initial_scale_power: int = 16
    """The first scale is 2**initial_scale_power."""

    growth_interval: int = 1000
    """Double the scale after this many consecutive steps without overflow."""

    hysteresis: int = 2
    """Number of overflows tolerated before the scale is lowered (DeepSpeed's meaning)."""

    min_scale: float = 1.0
    """The scale never drops below this; an overflow at the minimum is still skipped."""

    def __post_init__(self) -> None:
        if self.growth_interval < 1 or self.hysteresis < 1 or self.min_scale <= 0:
            raise ValueError(
                "LossScaleConfig needs growth_interval >= 1, hysteresis >= 1 and min_scale > 0, "
                f"got {self.growth_interval}, {self.hysteresis}, {self.min_scale}."
            )


def config_field_names() -> list[str]:
    """Names accepted by ZeroStrategy(**kwargs) besides its Lightning arguments."""
    return [f.name for f in fields(ZeroConfig)]


__all__ = ["ZeroConfig", "LossScaleConfig", "VALID_STAGES", "config_field_names"]
