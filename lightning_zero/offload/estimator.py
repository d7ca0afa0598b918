"""Memory needed per GPU, per node (host RAM) and on NVMe for every ZeRO stage and offload setting.

The figures are the buffers lightning_zero itself allocates (offload/engine.py and zero/ sizes them
the same way; the engine's host-memory check calls :func:`offload_host_bytes_per_rank`), for
mixed-precision training with Adam: 16-bit parameters and gradients, fp32 masters, two fp32 moments.
Activations, the CUDA context, communication buffers and allocator fragmentation come on top and
depend on batch size and model shape: the figures are the *model state* floor.

Per rank, with P parameters, N data-parallel ranks, S = P / N, c bytes per 16-bit value (4 in fp32)
and U the largest unit (stage 3: one transformer block):

==========================  ==================================  ======================================
setting                     device                              host (+ NVMe)
==========================  ==================================  ======================================
zero0                       2cP + 16P (fp32: 16P)               -
zero1                       2cP + 16S                           -
zero2                       cP + 16S + bucket                   -
zero3                       cS + 16S + (prefetch + 3) cU        -
optimizer cpu, stage 1      2cP                                 12S + 2cS (masters, moments, grads, upload)
optimizer cpu, stage 2      cP + bucket                         same
optimizer cpu, stage 3      cS + (prefetch + 3) cU              same
+ params cpu                (prefetch + 3) cU                   same (the step writes the partitions in place)
optimizer nvme              as cpu                              2cS + ring (+ cS upload unless params cpu); NVMe 12S
params nvme                 (prefetch + 3) cU                   staging; NVMe cS
==========================  ==================================  ======================================

(The upload buffer is omitted in fp32 with the CPU optimizer, whose masters are uploaded directly;
gradient accumulation adds an fp32 accumulator of 4S; the delayed update doubles grads and upload. With
16-bit device states, ``state_precision``, the 16S of stages 1-3 become 10S or 12S, 8S or 10S with bf16
gradient shards, and stage 3 loses its cS: ``device_state_coefficients``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

GIB = 2.0**30


@dataclass(frozen=True)
class Setting:
    """One stage/offload combination."""

    stage: int
    offload_optimizer: str = "none"
    offload_params: str = "none"

    @property
    def name(self) -> str:
        """The registered strategy name where there is one, else the options spelled out."""
        base, opt, par = f"zero{self.stage}", self.offload_optimizer, self.offload_params
        if opt == "none":
            return base
        if opt == "cpu" and par == ("none" if self.stage < 3 else "cpu"):
            return f"{base}_offload"
        if opt == par == "nvme":
            return f"{base}_offload_nvme"
        return f"{base} optimizer={opt} params={par}"


SETTINGS: tuple[Setting, ...] = (
    Setting(0), Setting(1), Setting(2), Setting(3),
    Setting(1, "cpu"), Setting(2, "cpu"), Setting(3, "cpu"), Setting(3, "cpu", "cpu"),
    Setting(3, "nvme", "cpu"), Setting(3, "nvme", "nvme"),
)
"""Every combination the estimator reports, cheapest on the device last."""


@dataclass(frozen=True)
class Workload:
    """What besides the parameter count decides the figures."""

    params: int
    gpus_per_node: int = 1
    nodes: int = 1
    largest_unit: Optional[int] = None
    """Parameters of the largest stage-3 unit; None assumes a 24-block transformer (P / 24)."""
    compute_bytes: int = 2
    """2 for bf16/fp16 mixed precision, 4 for 32-true."""
    bucket_numel: int = 25 * 2**20
    """Stage 2 gradient bucket (ZeroConfig.bucket_size_mb in elements)."""
    prefetch_units: int = 1
    accumulate: bool = False
    delayed_update: bool = False
    nvme_chunk_numel: int = 64 * 2**20
    nvme_fraction: float = 1.0
    """Share of the masters and optimizer states on NVMe ('nvme' optimizer offload); the rest in host memory."""
    state_bytes: float = 12.0
    """Host bytes per parameter of the CPU optimizer's master and moments: 12 in fp32, fewer with a compact
    ``offload_state_precision`` (lightning_zero/optim/host_states.py ``bytes_per_param``). A compact state
    is built in the memory of the fp32 master it is filled from (host_states.py [Note: adopting the fp32
    master]), so construction needs no more than training."""
    master_in_params: bool = False
    """A bf16 host state whose master is the 16-bit parameter partition (stage 3, parameters in host
    memory, bf16 compute): ``compute_bytes`` per parameter fewer than ``state_bytes`` plus the partition."""
    device_state_bytes: float = 12.0
    """Device bytes per partition parameter of the master and Adam moments without offload: 12 in fp32, 6
    or 8 with ``state_precision`` 'bf16_sr' or 'bf16_kahan' (zero/states16.py)."""
    grad_shard_bytes: float = 4.0
    """Device bytes per partition parameter of the reduced-gradient shard: 4, or 2 with
    ``grad_shard_precision='bf16'`` (16-bit device states only)."""

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def shard(self) -> float:
        return self.params / self.ranks

    @property
    def unit(self) -> float:
        return self.largest_unit if self.largest_unit is not None else self.params / 24


@dataclass(frozen=True)
class Estimate:
    """Bytes needed by one setting: per device, per node's host memory, per node's NVMe."""

    setting: Setting
    gpu_bytes: int
    cpu_bytes: int
    nvme_bytes: int


def device_state_coefficients(s: Setting, compute_bytes: int = 2, ranks: Optional[int] = None, states: float = 12.0,
                              grads: float = 4.0) -> tuple[float, float]:
    """THE bytes-per-parameter formula of the device's model state: ``(full, shard)`` such that a rank
    holds ``full * P + shard * P / N`` bytes at the optimizer step (16-bit or fp32 parameters, gradients,
    fp32 masters, the fp32 gradient partition the step reads, Adam's two moments). Working buffers (stage
    2's gradient buckets, stage 3's gathered units) come on top (:func:`device_working_bytes`).

    [Note: one formula] The README's table, ``python -m lightning_zero.estimate`` and the engines' own
    host check all read this; tests/offload/test_estimator_storage.py counts the storage of real runs
    inside the optimizer step against it (within 5%). At the step, stages 1-3 hold the rank's gradient
    partition in fp32 (4 bytes per shard parameter, filled from the 16-bit gradients) next to the master;
    stage 0 steps its masters from an fp32 copy of its 16-bit flat gradients made at the step (4 bytes per
    parameter, transient; none in fp32, where the flat gradients are fp32 already). On ONE rank stage 1
    steps as stage 0 does (zero/stage1.py [Note: stage 1 on one rank]), and stages 2-3 send their
    gradients straight into the fp32 partition (stage2.py [Note: one data-parallel rank]), so no stage
    needs more than zero0 on one GPU; from N = 2 on every stage needs less. In fp32 (``compute_bytes=4``)
    with one rank (``ranks=1``), stages 1-2 use the flat fp32 parameters as the master (zero/flat_group.py
    ``shares_master``): 4 bytes per parameter fewer; with ``ranks=None`` the formula is the one for N >= 2.
    16-bit device states (``states`` 6 or 8 instead of 12, bf16 compute, no offload; zero/states16.py):
    master and moments take ``states`` and the gradient shard ``grads`` per partition parameter; stage 3 has
    no separate 16-bit partition (the master is what it gathers), and stage 1 on one rank steps from the
    bf16 flat gradients themselves (no fp32 copy).
    """
    c = compute_bytes
    if states != 12.0 and s.offload_optimizer == "none" and s.stage >= 1:
        if s.stage == 1 and ranks == 1:
            return 2 * c + states, 0.0
        return {1: 2.0 * c, 2: float(c), 3: 0.0}[s.stage], states + grads
    master = 0 if c == 4 else 4  # in fp32 the parameters are the masters
    shared = 4.0 if c == 4 and ranks == 1 else 0.0  # fp32, one rank: stages 1-2's master is the flat parameter
    if s.offload_optimizer == "none":
        if s.stage == 0 or (s.stage == 1 and ranks == 1):  # [Note: stage 1 on one rank]
            return 2 * c + master + 8 + (4 if c != 4 else 0), 0.0  # the fp32 copy of the gradients at the step
        if s.stage == 1:
            return 2 * c, 16.0 - shared
        if s.stage == 2:
            return c, 16.0 - shared
        return 0.0, (c if c != 4 else 0) + 16.0
    if s.stage == 1:
        return 2 * c, 0.0
    if s.stage == 2:
        return c, 0.0
    return 0.0, (c if s.offload_params == "none" else 0)


def device_working_bytes(s: Setting, w: Workload) -> float:
    """Transient device buffers on top of the model state: stage 2's gradient buckets (two, in flight),
    stage 3's gathered units (live + prefetched + root) and their gradient staging."""
    c = w.compute_bytes
    if s.stage == 2:
        return 2 * c * min(w.bucket_numel, w.params)
    if s.stage == 3:
        return (w.prefetch_units + 3) * c * w.unit
    return 0.0


def per_param_formula(s: Setting, compute_bytes: int = 2, states: float = 12.0, grads: float = 4.0) -> str:
    """``device_state_coefficients`` as text, e.g. ``4 + 16/N`` (what the README's table shows)."""
    full, shard = device_state_coefficients(s, compute_bytes, states=states, grads=grads)
    terms = ([f"{full:g}"] if full else []) + ([f"{shard:g}/N"] if shard else [])
    return " + ".join(terms) or "0"


def _device_bytes(s: Setting, w: Workload) -> float:
    full, shard = device_state_coefficients(s, w.compute_bytes, w.ranks, w.device_state_bytes, w.grad_shard_bytes)
    return full * w.params + shard * w.shard + device_working_bytes(s, w)


def offload_host_bytes_per_rank(s: Setting, w: Workload) -> float:
    """Host memory one rank's offload buffers take (0 without offload); the engine checks this."""
    if s.offload_optimizer == "none":
        return 0.0
    c, S = w.compute_bytes, w.shard
    grads = c * S * (2 if w.delayed_update else 1) + (4 * S * (2 if w.delayed_update else 1) if w.accumulate else 0)
    uploads = 2 if w.delayed_update else 1
    total = grads
    in_place = s.offload_params == "cpu" and c != 4 and not w.delayed_update  # the step writes the partitions
    if s.offload_optimizer == "cpu":
        total += (w.state_bytes - (c if w.master_in_params and in_place else 0)) * S
        compact = w.state_bytes != 12.0
        if (c != 4 or w.delayed_update or compact) and not in_place:
            total += uploads * c * S
    else:  # nvme: ring of three chunk sets (master + 2 moments), an upload buffer, chunks kept in memory
        total += 3 * 3 * 4 * min(w.nvme_chunk_numel, S) + 12 * S * (1.0 - w.nvme_fraction)
        if not in_place:
            total += uploads * c * S
    if s.offload_params == "cpu":
        total += c * S
    elif s.offload_params == "nvme":
        total += (2 * w.prefetch_units + 2) * c * w.unit / w.ranks  # read-ahead ring of unit chunks (params.ring_depth)
    return total


def nvme_build_peak_bytes_per_rank(s: Setting, w: Workload) -> float:
    """Host memory while an 'nvme' engine is built: full fp32 masters (then swapped out), the 16-bit
    partitions (params 'cpu', or 'nvme' before they are swapped out) and the chunks kept in memory."""
    return 4 * w.shard + w.compute_bytes * w.shard * (s.offload_params != "none") + 4 * w.shard * (1 - w.nvme_fraction)


def nvme_bytes_per_rank(s: Setting, w: Workload) -> float:
    total = 0.0
    if s.offload_optimizer == "nvme":
        total += 12 * w.shard * w.nvme_fraction
    if s.offload_params == "nvme":
        total += w.compute_bytes * w.shard
    return total


def estimate(s: Setting, w: Workload) -> Estimate:
    return Estimate(
        s,
        gpu_bytes=int(_device_bytes(s, w)),
        cpu_bytes=int(offload_host_bytes_per_rank(s, w) * w.gpus_per_node),
        nvme_bytes=int(nvme_bytes_per_rank(s, w) * w.gpus_per_node),
    )


def estimate_all(w: Workload) -> list[Estimate]:
    return [estimate(s, w) for s in SETTINGS]


# ---------------------------------------------------------------------------------------- from a model
def count_params(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, largest unit): units as stage 3's default policy (ModuleList children)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    largest = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                largest = max(largest, sum(p.numel() for p in child.parameters() if p.requires_grad))
    return total, largest or total


def estimate_model(model: nn.Module, gpus_per_node: int = 1, nodes: int = 1, **workload: Any) -> list[Estimate]:
    """Every setting's figures for ``model`` (meta-device models work: only shapes are read)."""
    total, largest = count_params(model)
    return estimate_all(Workload(total, gpus_per_node, nodes, largest_unit=largest, **workload))


# ---------------------------------------------------------------------------------------- what fits
@dataclass(frozen=True)
class Machine:
    """Per-node capacity the 'largest model' figures are computed for (None: unlimited/unknown)."""

    gpu_bytes: Optional[float]
    cpu_bytes: Optional[float]
    nvme_bytes: Optional[float]


def fits(e: Estimate, m: Machine) -> bool:
    return all(cap is None or need <= cap for need, cap in
               ((e.gpu_bytes, m.gpu_bytes), (e.cpu_bytes, m.cpu_bytes), (e.nvme_bytes, m.nvme_bytes)))


def largest_fitting(s: Setting, m: Machine, make: Callable[[int], Workload]) -> tuple[int, str]:
    """The largest parameter count whose figures fit ``m`` (bisection), and what limits it."""
    if m.gpu_bytes is None and m.cpu_bytes is None and m.nvme_bytes is None:
        return 0, "no capacity known"
    lo, hi = 0, 1
    while fits(estimate(s, make(hi)), m) and hi < 10**15:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 1000):
        mid = (lo + hi) // 2
        if fits(estimate(s, make(mid)), m):
            lo = mid
        else:
            hi = mid
    over = estimate(s, make(hi))
    limits = [name for name, need, cap in (("GPU", over.gpu_bytes, m.gpu_bytes), ("CPU", over.cpu_bytes, m.cpu_bytes),
                                           ("NVMe", over.nvme_bytes, m.nvme_bytes)) if cap is not None and need > cap]
    return lo, "/".join(limits) or "-"
