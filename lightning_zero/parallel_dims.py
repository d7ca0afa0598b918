"""Pipeline x data-parallel x tensor-parallel layout of the ranks: one torch ``DeviceMesh``.

Ranks are laid out pipeline-major, then data parallel, tensor parallel innermost (torchtitan's order):
``global_rank = (pp_rank * dp + dp_rank) * tp + tp_rank``, so the ranks of one tensor-parallel group
are contiguous (on one host, where TP's per-layer collectives need the fastest links). The data-parallel
group of a rank holds the ranks of the same pipeline stage and TP rank (ZeRO partitions inside it); the
pipeline group holds one rank of every stage with the same ``(dp_rank, tp_rank)`` (activations flow
inside it); the tensor-parallel group holds the ``tp`` ranks sharing one replica of one stage.

[Note: one mesh]
Every group the engines use comes from one ``DeviceMesh`` with dims ``("pp", "dp", "tp")`` (size-1
dims kept, so ``mesh["tp"]`` exists whatever the degrees), the mesh torch's tensor-parallel tools
(``parallelize_module``, DTensor) take, and the one the LightningModule sees as ``self.device_mesh``
in ``configure_model``, as under Lightning's ``ModelParallelStrategy``. One exception: ZeRO-3's
parameter all-gathers need a second group over the data-parallel ranks (stage3.py's [Note: two process
groups]); a mesh has one group per dim, so that one is created here beside it, with the same ranks.
Groups are created here and nowhere else; an instance owns them (no globals).

[Note: expert-parallel groups]
With ``ep`` > 1 (Mixture of Experts, issue #20) the data-parallel ranks split into ``dp / ep`` groups of
``ep`` contiguous ranks, ``dp_rank = edp_rank * ep + ep_rank`` (DeepSpeed's layout: an expert-parallel
group on one host, where its all-to-alls need the fastest links). ``ep_group``: the ranks holding
*different* experts of one replica (tokens are exchanged there); ``edp_group``: the ranks holding the
*same* experts (``ep_rank`` equal; expert gradients are reduced and partitioned there), with
``edp_param_group`` beside it for ZeRO-3's gathers as for dp. They are plain groups beside the mesh, not
mesh dims: splitting the mesh's "dp" dim in two needs DeviceMesh's private ``_unflatten`` (absent from
the torch versions we support), and the mesh the module sees keeps its three dims.

[Note: sequence-parallel groups]
With ``sp`` > 1 (issue #30) the data-parallel ranks split into ``dp / sp`` groups of ``sp`` contiguous
ranks, ``dp_rank = data_rank * sp + sp_rank``; the ``sp`` ranks of a group train the same samples, each
holding ``1/sp`` of every sequence. Their weights are identical, so ZeRO keeps partitioning over the
whole "dp" dim (dp x sp ranks in torchtitan's terms): gradients are averaged over it as before, which
with the sequence loss (sequence/batch.py) gives the gradient of the global token mean. Only the sampler
(``data_parallel`` replicas, ``data_rank``) and attention (``sp_group``) see the split; the mesh keeps its
three dims.

[Note: hpZ groups]
ZeRO++'s hierarchical partition (``hpz`` > 1, config/quantization.py) splits the data-parallel ranks into
``dp / hpz`` groups of ``hpz`` contiguous ranks (a node: ``dp_rank = node * hpz + local``), the
``("replicate", "shard")`` layout of the "dp" dim: ``hpz_param_group`` holds a node's ranks, among which
backward re-gathers each unit's secondary copy (stage 3, zero/zeropp.py); ``hpz_grad_group`` (same ranks)
and ``hpz_cross_group`` (the ranks of equal ``local`` index, one per node) carry the two levels of the
quantized gradient reduce-scatter. Plain groups beside the mesh, for the reason given for experts; none
when ``hpz`` is 1 or the whole dp degree (plain stage 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_zero.comm import collectives as C

MESH_DIMS = ("pp", "dp", "tp")
"""Names of the mesh dims, outermost first."""


@dataclass
class ParallelDims:
    """Degrees of parallelism and this rank's coordinates; ``build_groups`` creates the mesh and groups."""

    world_size: int
    global_rank: int
    pp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert-parallel degree (a divisor of dp; see [Note: expert-parallel groups])."""
    sp: int = 1
    """Sequence-parallel degree (a divisor of dp; see [Note: sequence-parallel groups])."""
    hpz: int = 1
    """ZeRO++'s secondary partition size (a divisor of dp; see [Note: hpZ groups])."""
    mesh: Optional[Any] = field(default=None, repr=False)
    """The ``DeviceMesh`` (None in a single process without a default process group)."""
    dp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    pp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    tp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    dp_host_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    """A gloo group over ``dp_group``'s ranks (``dp_group`` itself under gloo): host-side agreements, such as which
    buffers to broadcast (zero/buffers.py [Note: buffer sync])."""
    dp_param_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    """Same ranks as ``dp_group``; ZeRO-3's parameter all-gathers run here (stage3.py's
    [Note: two process groups])."""
    ep_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    edp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    edp_param_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    sp_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    hpz_param_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    hpz_grad_group: Optional[C.ProcessGroup] = field(default=None, repr=False)
    hpz_cross_group: Optional[C.ProcessGroup] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "tp"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{'pipeline_stages' if name == 'pp' else 'tensor_parallel'} must be an integer >= 1, got {value!r}.")
        if self.world_size % (self.pp * self.tp) != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by pipeline_stages={self.pp} x tensor_parallel={self.tp} "
                f"= {self.pp * self.tp}: the world size must equal data-parallel degree x pipeline stages x "
                "tensor-parallel degree. Change the number of devices or the degrees."
            )
        if self.dp % self.sp != 0:
            raise ValueError(
                f"sequence_parallel={self.sp} does not divide the data-parallel degree {self.dp} (world size "
                f"{self.world_size}): each sequence is split over sequence_parallel ranks, and every rank must be in "
                "one group. Change the number of devices or sequence_parallel."
            )
        if isinstance(self.ep, bool) or not (isinstance(self.ep, int) and self.ep >= 1):
            raise ValueError(f"expert_parallel must be an integer >= 1, got {self.ep!r}.")
        if self.dp % self.ep != 0:
            raise ValueError(
                f"expert_parallel={self.ep} does not divide the data-parallel degree {self.dp} (world size "
                f"{self.world_size}): experts are split over groups of expert_parallel ranks, and every rank must "
                "be in one. Change the number of devices or expert_parallel."
            )

        if isinstance(self.hpz, bool) or not (isinstance(self.hpz, int) and self.hpz >= 1) or self.dp % self.hpz:
            raise ValueError(
                f"hpz_partition_size={self.hpz!r} does not divide the data-parallel degree {self.dp} (world size "
                f"{self.world_size}): each secondary partition spans hpz_partition_size ranks (a node), and every rank "
                "must be in one. Use the number of GPUs per node, or a divisor of it."
            )

    @property
    def hierarchical(self) -> bool:
        """Whether hpZ splits the data-parallel ranks ([Note: hpZ groups]; hpz 1 or dp: plain stage 3)."""
        return 1 < self.hpz < self.dp

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    @property
    def tp_rank(self) -> int:
        return self.global_rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.global_rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.global_rank // (self.dp * self.tp)

    @property
    def data_parallel(self) -> int:
        """Replicas that see different samples: dp / sp ([Note: sequence-parallel groups])."""
        return self.dp // self.sp

    @property
    def data_rank(self) -> int:
        """Which samples this rank sees (its sequence-parallel group's index)."""
        return self.dp_rank // self.sp

    @property
    def sp_rank(self) -> int:
        """This rank's slice of each sequence."""
        return self.dp_rank % self.sp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts ([Note: expert-parallel groups])."""
        return self.dp // self.ep

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def dp_ranks(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        return [self.rank_of(pp_rank, d, tp_rank) for d in range(self.dp)]

    def pp_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        return [self.rank_of(s, dp_rank, tp_rank) for s in range(self.pp)]

    def build_groups(self, timeout_s: Optional[float] = None, device_type: str = "cpu") -> None:
        """Create the mesh and the groups (collective: every rank calls it, in the same order); see
        [Note: one mesh]. ``device_type``: the mesh's ('cuda' under NCCL, 'cpu' under gloo)."""
        self.mesh = C.init_device_mesh(device_type, (self.pp, self.dp, self.tp), MESH_DIMS, timeout_s)
        if self.mesh is None:
            return
        self.dp_group = self.mesh["dp"].get_group()
        self.dp_host_group = C.host_twin(self.dp_group, timeout_s)
        self.tp_group = self.mesh["tp"].get_group()
        self.pp_group = self.mesh["pp"].get_group() if self.pp > 1 else None
        for s in range(self.pp):
            for t in range(self.tp):
                g = C.new_group(self.dp_ranks(s, t), timeout_s)
                if (s, t) == (self.pp_rank, self.tp_rank):
                    self.dp_param_group = g
        if self.ep > 1:
            self._build_expert_groups(timeout_s)
        if self.hierarchical:
            self._build_hpz_groups(timeout_s)
        if self.sp > 1:
            dp_ranks = self.dp_ranks(self.pp_rank, self.tp_rank)
            for d in range(self.data_parallel):
                g = C.new_group(dp_ranks[d * self.sp : (d + 1) * self.sp], timeout_s)
                if d == self.data_rank:
                    self.sp_group = g

    def _build_hpz_groups(self, timeout_s: Optional[float]) -> None:
        """[Note: hpZ groups] (collective; pp = tp = 1, which the config enforces)."""
        dp_ranks = self.dp_ranks(self.pp_rank, self.tp_rank)
        node, local = divmod(self.dp_rank, self.hpz)
        for kind in ("hpz_param_group", "hpz_grad_group"):
            for n in range(self.dp // self.hpz):
                g = C.new_group(dp_ranks[n * self.hpz : (n + 1) * self.hpz], timeout_s)
                if n == node:
                    setattr(self, kind, g)
        for k in range(self.hpz):
            g = C.new_group(dp_ranks[k :: self.hpz], timeout_s)
            if k == local:
                self.hpz_cross_group = g

    def _build_expert_groups(self, timeout_s: Optional[float]) -> None:
        """[Note: expert-parallel groups] (collective; pp = tp = 1, which the config enforces)."""
        dp_ranks = self.dp_ranks(self.pp_rank, self.tp_rank)
        for e in range(self.edp):
            g = C.new_group(dp_ranks[e * self.ep : (e + 1) * self.ep], timeout_s)
            if e == self.edp_rank:
                self.ep_group = g
        for kind in ("edp_group", "edp_param_group"):
            for k in range(self.ep):
                g = C.new_group(dp_ranks[k :: self.ep], timeout_s)
                if k == self.ep_rank:
                    setattr(self, kind, g)

    def build_stage_group(self, stages: list[int], timeout_s: Optional[float] = None) -> Optional[C.ProcessGroup]:
        """Groups over the given pipeline stages, one per data-parallel x tensor-parallel replica
        (collective: every rank calls it, in the same order); this rank's group, or None when its stage is
        not among ``stages``. Tied layers use them (pipeline/tied.py): the copies of one tied module
        all-reduce their gradients."""
        mine: Optional[C.ProcessGroup] = None
        for d in range(self.dp):
            for t in range(self.tp):
                group = C.new_group([self.pp_ranks(d, t)[s] for s in stages], timeout_s)
                if (d, t) == (self.dp_rank, self.tp_rank) and self.pp_rank in stages:
                    mine = group
        return mine
