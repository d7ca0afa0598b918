"""ZeRO++ in stage 3 (issue #33): which collective moves a unit's weights and a bucket's gradients, the hpZ
secondary copies, and the bytes each one sends.

[Note: ZeRO++ in stage 3]
DeepSpeed's ZeRO++ cuts stage 3's traffic three ways, each switchable (config/quantization.py):

* *qwZ*: a unit's all-gather sends block-quantized int8 codes of each rank's partition, dequantized into the
  unit's full buffer (comm/quantized.py). Only that gathered copy is quantized: the partitions, the fp32
  masters and the optimizer never see a quantized value, so the error does not accumulate across steps:
  each forward and backward computes with weights within half a quantization step of the exact ones.
  Gathers that must be exact stay so: persistent units (small, gathered once per step), and
  ``gathered_params`` (user code, writeback), which re-gathers exactly a unit it finds quantized.
* *hpZ*: when forward gathers a unit (grad enabled, not a persistent or whole-step unit), each rank keeps
  its ``1/h`` slice of the gathered buffer, in the compute dtype, with ``h = hpz_partition_size`` the node's
  ranks (parallel_dims.py [Note: hpZ groups]). Until the end of the backward (``drop_secondaries``, called
  by ``post_backward`` and after a step) every gather of that unit, backward's re-gather and a
  checkpointed forward's recomputation included, all-gathers these slices inside the node instead of the
  partitions across all ranks. The slices are a copy of what forward used, so hpZ alone computes exactly
  what zero3 computes (same values, same gradient reduction: bit for bit), and with qwZ the backward
  sees the very weights the forward saw. The decision to use a secondary copy depends only on the program
  (which units were gathered in a grad-enabled forward), so every rank of a node takes it alike.
* *qgZ*: a bucket's gradient reduce-scatter is an all-to-all of block-quantized int8/int4 chunks, each
  rank dequantizing what it receives and summing it in fp32; with hpZ on, in two levels (inside the node,
  then across nodes with the partial sums re-quantized: comm/quantized.py; a bucket's cross-node level is
  launched when the next bucket's reduction is, in bucket order on every rank). The fp32 sum is divided by
  the data-parallel size and written (or added) straight into the fp32 gradient shard, never rounded to the
  compute dtype (comm/quantized.py [Note: qgZ into the gradient shard]).

Every byte is counted in the engine's :class:`Traffic` under a label: ``param_gather`` (partitions across
the data-parallel ranks), ``param_gather_node`` (hpZ's secondary copies inside a node), ``grad_reduce``
(one level across the data-parallel ranks), ``grad_reduce_node`` and ``grad_reduce_cross`` (the two levels).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.comm import quantized as Q
from lightning_zero.comm.traffic import Traffic, ring_bytes
from lightning_zero.config.quantization import QuantCommConfig

log = logging.getLogger(__name__)

BITS = {"int8": 8, "int4": 4}

BucketKey = tuple[int, int]
"""(flat group index, bucket index) of a unit's segment."""


@dataclass(frozen=True)
class HpzGroups:
    """The groups hpZ uses (parallel_dims.py [Note: hpZ groups]); None where hpZ is off."""

    param_group: Optional[C.ProcessGroup]
    """A node's ranks: backward's gathers of the secondary copies."""
    grad_group: Optional[C.ProcessGroup]
    """The same ranks: the first level of the quantized gradient reduce-scatter."""
    cross_group: Optional[C.ProcessGroup]
    """One rank per node, of equal position: the second level."""


def rounding_seed(reduction: int, rank: int, level: int) -> int:
    """Stochastic rounding's seed (quant/blocks.py [Note: stochastic rounding of codes]): the three counts
    mixed by odd multipliers (golden-ratio and murmur3 constants) and a final xor-shift, 31 bits kept."""
    x = (reduction * 0x9E3779B1 + rank * 0x85EBCA77 + level * 0xC2B2AE3D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return (x ^ (x >> 12)) & 0x7FFFFFFF


class ZeroPP:
    """The ZeRO++ collectives and hpZ copies of one stage-3 engine (see [Note: ZeRO++ in stage 3]); with every
    switch off it issues stage 3's exact collectives and only counts their bytes."""

    def __init__(self, cfg: QuantCommConfig, hpz: Optional[HpzGroups], traffic: Traffic) -> None:
        self.weight_bits: Optional[int] = BITS.get(cfg.quantized_weights) if cfg.quantized_weights else None
        self.grad_bits: Optional[int] = BITS.get(cfg.quantized_gradients) if cfg.quantized_gradients else None
        self.block = cfg.quant_block_size
        self.stochastic = cfg.gradient_rounding == "stochastic"
        self._reductions = 0
        """Quantized reductions launched by this engine: with the rank, what seeds each one's rounding."""
        self.hpz = hpz
        self.traffic = traffic
        self._secondary: dict[BucketKey, Tensor] = {}
        self._units: set[int] = set()
        """Units whose secondary copies are current (made by this step's forward)."""
        self._two_level: list[Q.TwoLevelWork] = []
        """The last two-level reduction launched: its cross-node level starts when the next one launches
        (every rank launches in bucket order, so the cross-node exchanges keep that order)."""
        if (self.weight_bits or self.grad_bits or hpz is not None) and C.rank() == 0:
            log.info("lightning_zero: %s", self.describe())  # every precision choice visible in the logs

    @property
    def keeps_secondaries(self) -> bool:
        return self.hpz is not None

    # ---------------------------------------------------------------- weights
    def gather(self, out: Tensor, src: Tensor, group: Optional[C.ProcessGroup], exact: bool) -> Any:
        """Launch the all-gather of every rank's ``src`` into ``out``: quantized under qwZ unless ``exact``."""
        n = C.world_size(group)
        if self.weight_bits is not None and not exact and n > 1:
            work = Q.start_all_gather(out, src, group, self.weight_bits, self.block)
            self.traffic.add("param_gather", work.nbytes)
            return work
        self.traffic.add("param_gather", ring_bytes(src.numel(), src.element_size(), n))
        return C.all_gather(out, src, group, async_op=True)

    def has_secondary(self, unit: int) -> bool:
        return unit in self._units

    def gather_secondary(self, out: Tensor, key: BucketKey) -> Any:
        """Launch the all-gather of the node's secondary copies of bucket ``key`` into ``out`` (exact)."""
        assert self.hpz is not None
        src = self._secondary[key]
        self.traffic.add("param_gather_node", ring_bytes(src.numel(), src.element_size(),
                                                         C.world_size(self.hpz.param_group)))
        return C.all_gather(out, src, self.hpz.param_group, async_op=True)

    def keep_secondary(self, unit: int, pieces: list[tuple[BucketKey, Tensor]]) -> None:
        """This rank's slice of each freshly gathered full buffer, kept until :meth:`drop_secondaries`."""
        assert self.hpz is not None
        h, local = C.world_size(self.hpz.param_group), C.rank(self.hpz.param_group)
        for key, full in pieces:
            part = full.numel() // h  # buckets are padded to a multiple of dp, which h divides
            self._secondary[key] = full[local * part : (local + 1) * part].clone()
        self._units.add(unit)

    def drop_secondaries(self) -> None:
        """End of a backward (every reduction waited) or a step: the copies are stale from here."""
        self._secondary.clear()
        self._units.clear()
        self._two_level = []

    def secondary_bytes(self) -> int:
        """Storage of the secondary copies held now (memory reports and tests)."""
        return sum(t.numel() * t.element_size() for t in self._secondary.values())

    # ---------------------------------------------------------------- gradients
    @property
    def quantizes_gradients(self) -> bool:
        return self.grad_bits is not None

    def start_reduce_scatter(self, bucket: Tensor, group: Optional[C.ProcessGroup], divisor: int = 1,
                             into: Optional[Q.Into] = None) -> Q.QuantizedWork:
        """qgZ: launch the quantized reduce-scatter of ``bucket`` over ``group`` (two levels under hpZ);
        ``result`` (fp32, this rank's chunk of the sum divided by ``divisor``: on CUDA in the same kernel)
        once waited, written (or added) by the last level into the destination ``into`` gives, if given."""
        assert self.grad_bits is not None
        self._reductions += 1
        seeds = (self._seed(0), self._seed(1)) if self.stochastic else (None, None)
        if self.hpz is not None:
            for earlier in self._two_level:  # their cross-node level overlaps the rest of backward
                earlier.advance()
            work = Q.start_reduce_scatter_hierarchical(bucket, self.hpz.grad_group, self.hpz.cross_group,
                                                       self.grad_bits, self.block, divisor, into, seeds)
            self._two_level = [work]
            self.traffic.add("grad_reduce_node", work.levels[0])
            self.traffic.add("grad_reduce_cross", work.levels[1])
            return work
        work = Q.start_reduce_scatter(bucket, group, self.grad_bits, self.block, divisor, into, seed=seeds[0])
        self.traffic.add("grad_reduce", work.nbytes)
        return work

    def _seed(self, level: int) -> int:
        """A seed in ``[0, 2**31)`` for this reduction, rank and hierarchy level: ranks and levels draw
        independent roundings, so their errors average out in the sum instead of lining up."""
        return rounding_seed(self._reductions, C.rank(), level)

    def count_exact_reduce(self, chunk_numel: int, element_size: int, n: int) -> None:
        self.traffic.add("grad_reduce", ring_bytes(chunk_numel, element_size, n))

    def describe(self) -> str:
        """One line for the logs: what each switch does in this run."""
        parts = [f"weights all-gathered in int{self.weight_bits} blocks of {self.block}" if self.weight_bits
                 else "weights all-gathered exactly",
                 f"gradients reduce-scattered in int{self.grad_bits} blocks of {self.block}"
                 f"{', rounded stochastically' if self.stochastic else ''}, summed in fp32"
                 if self.grad_bits else "gradients reduce-scattered exactly"]
        if self.hpz is not None:
            parts.append(f"hpZ: backward re-gathers within groups of {C.world_size(self.hpz.param_group)} ranks")
        return "ZeRO++: " + "; ".join(parts) + "."
