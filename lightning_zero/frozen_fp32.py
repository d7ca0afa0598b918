"""Exact fp32 values of the frozen parameters the cast layout computes in 16 bits.

[Note: frozen fp32 parameters under the cast layout]
Under ``mixed_precision='cast'`` (precision.py [Note: two mixed-precision layouts]) the module is cast to 16 bits
and every trainable parameter keeps its fp32 value in its engine's master. A frozen parameter (a LoRA base built
in fp32, ``requires_grad=False`` or in no optimizer) has no master, so the cast used to be all that was left of
it: the module after fit, ``full_state_dict()`` and both checkpoint formats held it rounded to 16 bits (measured
4.8e-4 off the user's values under ``bf16-mixed``, stages 0-3), where ddp's ``bf16-mixed`` keeps it as built.
Weights the user built are theirs, so before the cast (before stage 3 partitions them) this rank keeps an fp32
copy of its even share of each such parameter, on the host: the share checkpoints write (layout.py
``even_range`` over the ranks that hold the parameter whole, the expert-data-parallel ranks for an expert's).
The cost is 4 bytes per frozen parameter over those ranks, less than the fp32 module the user held before
set-up. The forward still computes with the 16-bit copy (DeepSpeed's layout, as for the trainable weights);
what is read back, saved and loaded is the fp32 value:

* ``full_state_dict()`` (and so the module a fit hands back, after_fit.py, and the full checkpoint format)
  gathers the shares (:meth:`FrozenFp32.full`, collective);
* sharded checkpoints write each rank's share and, loading, read the whole fp32 value, refreshing both the
  share and the 16-bit copy the forward uses (checkpoint/layout.py);
* a full state dict loaded into the strategy refreshes the shares (:meth:`FrozenFp32.set_full`).

Parameters built on the meta device (their values are materialised by us, not the user's), Fabric's
``setup_module`` before any optimizer exists, and shares that would take over :data:`HOST_SHARE` of the host's
free memory (:func:`fits_on_host`, one answer for all ranks) are not covered; apply.py's warning names them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.offload.pinned import available_host_bytes
from lightning_zero.parallel.dtensor import local_tensor

HOST_SHARE = 0.5
"""The shares of all ranks on a node may take at most this share of the host's free memory (after_fit.py's)."""

ShareOf = Callable[[Tensor], tuple[int, int, Optional[C.ProcessGroup]]]
"""A parameter -> (this rank's index, number of ranks, their group) among the ranks holding it whole."""


def even_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s share of ``numel`` elements split evenly over ``size`` ranks (checkpoints write these)."""
    return numel * rank // size, numel * (rank + 1) // size


def takeable(p: Tensor) -> bool:
    """Whether :meth:`FrozenFp32.capture` copies ``p``: fp32 values the user built (not meta, not released)."""
    local = local_tensor(p).detach()
    return local.dtype == torch.float32 and not local.is_meta and local.untyped_storage().nbytes() > 0


def fits_on_host(params: Iterable[Tensor], size: int, ranks_per_node: int) -> bool:
    """Whether this node has room for every rank's shares (``size``: the ranks a parameter is split over) within
    :data:`HOST_SHARE` of its free memory; one answer for all ranks (collective), since the shares' gathers are
    collective and every rank must keep the same parameters."""
    need = sum(local_tensor(p).numel() * 4 for p in params if takeable(p)) // max(size, 1)
    ok = ranks_per_node * need <= HOST_SHARE * available_host_bytes()
    return all(C.all_gather_object(ok, None)) if C.is_initialized() and C.world_size() > 1 else ok


@dataclass
class Share:
    """This rank's exact fp32 values ``[lo, hi)`` of one frozen parameter's flattened (local TP) tensor."""

    shape: torch.Size
    lo: int
    hi: int
    rank: int
    size: int
    group: Optional[C.ProcessGroup]
    values: Tensor
    """fp32, on the host."""
    param: "weakref.ref[Tensor]"
    """The parameter itself: a key ``id()`` reused by another tensor once it is freed does not match."""


class FrozenFp32:
    """The shares of [Note: frozen fp32 parameters under the cast layout], keyed by ``id(param)``."""

    def __init__(self, shares: Optional[dict[int, Share]] = None) -> None:
        self.shares: dict[int, Share] = dict(shares or {})

    def __len__(self) -> int:
        return len(self.shares)

    def holds(self, t: object) -> bool:
        s = self.shares.get(id(t))
        return s is not None and s.param() is t

    def nbytes(self) -> int:
        """Host bytes this rank keeps (what an asynchronous save stages too)."""
        return sum(s.values.numel() * s.values.element_size() for s in self.shares.values())

    @classmethod
    def capture(cls, params: Iterable[Tensor], share_of: ShareOf, previous: Optional["FrozenFp32"] = None
                ) -> "FrozenFp32":
        """Copy this rank's share of every fp32 parameter in ``params`` (no collective: every rank holds them whole
        after the broadcast from rank 0). A parameter no longer fp32 (a second fit whose module kept its 16-bit
        weights) keeps the share ``previous`` took of it; meta and released parameters are skipped."""
        shares: dict[int, Share] = {}
        for p in params:
            local = local_tensor(p).detach()
            if id(p) in shares or not local.is_floating_point():
                continue
            if not takeable(p):
                if previous is not None and previous.holds(p):
                    shares[id(p)] = previous.shares[id(p)]
                continue
            rank, size, group = share_of(p)
            lo, hi = even_range(local.numel(), rank, size)
            values = local.reshape(-1)[lo:hi].to("cpu", copy=True)
            shares[id(p)] = Share(local.shape, lo, hi, rank, size, group, values, weakref.ref(p))
        return cls(shares)

    def piece(self, t: Tensor) -> tuple[int, Tensor]:
        """(start in the flattened tensor, this rank's fp32 values) of a held parameter."""
        s = self.shares[id(t)]
        return s.lo, s.values

    @torch.no_grad()
    def full(self, t: Tensor, device: torch.device) -> Tensor:
        """The whole fp32 value of a held parameter, on the host (collective over the ranks that hold it; every
        one of them must ask for the same parameters in the same order)."""
        s = self.shares[id(t)]
        numel = s.shape.numel()
        if s.size == 1:
            return s.values.view(s.shape).clone()
        width = -(-numel // s.size)  # the widest share
        where = C.device_for(s.group, device)
        mine = torch.zeros(width, dtype=torch.float32, device=where)
        mine[: s.hi - s.lo].copy_(s.values)
        gathered = torch.empty(width * s.size, dtype=torch.float32, device=where)
        C.all_gather(gathered, mine, s.group)
        out = torch.empty(numel, dtype=torch.float32)
        for r in range(s.size):
            lo, hi = even_range(numel, r, s.size)
            out[lo:hi].copy_(gathered[r * width : r * width + hi - lo])
        return out.view(s.shape)

    @torch.no_grad()
    def set_full(self, t: Tensor, value: Tensor) -> None:
        """A held parameter's share <- ``value`` (its whole local tensor, any dtype: a loaded state dict's)."""
        s = self.shares[id(t)]
        s.values.copy_(local_tensor(value).detach().reshape(-1)[s.lo : s.hi])
