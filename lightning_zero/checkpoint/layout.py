"""Which pieces of the model and optimizer state one rank writes, and where it reads them back.

[Note: sharded checkpoint keys]
Keys are layout-free, so any stage, world size, offload setting or pipeline layout reads them:

* ``state_dict.<name>``: the weight or buffer that Lightning's ``state_dict`` calls ``<name>``
  (flattened, pieces.py [Note: every tensor is stored flattened]); fp32 masters for the parameters
  an engine steps, the exact fp32 shares of frozen fp32 parameters under the cast layout (frozen_fp32.py
  [Note: frozen fp32 parameters under the cast layout]), stage 3's other frozen partitions in their
  compute dtype, everything else as held.
  A tensor under two names (tied weights) is stored once, under its first name.
* ``optimizer_states.<k>.state.<name>.<key>``: optimizer ``k``'s per-parameter state. Flat state
  (Adam's moments) is stored like the weights; per-group scalars (``step``) under every parameter's
  name, written by the rank that owns the parameter's first element.
* ``optimizer_states.<k>.comm.rank<r>``: a 1-bit optimizer's error feedback of global rank ``r``
  (only meaningful on the same world size, as before).

Tensor parallelism: a rank's pieces are ranges of its TP shard's flattening, placed in the global
tensor (its ``Block``), and a TP-sharded tensor is stored in its global n-D shape (pieces.py [Note:
tensor-parallel pieces]); keys, names and shapes in ``meta.pt`` are the global tensor's, so any tp
degree, or none, reads them. The tp ranks of one data-parallel replica hold the same replicated
tensors and write the same pieces of them: DCP keeps one copy.

Expert parallelism: expert tensors are named by global expert index (experts.py [Note: experts in
sharded checkpoints]) and split over the ranks holding the same experts (the expert-data-parallel
ranks), not over every data-parallel rank; an optimizer's flat groups of one param group (dense and
expert, zero/shard_comm.py) share its record.

Who writes what: a partition's owner writes its pieces; a tensor every data-parallel rank holds
whole (buffers, stage 0's masters, parameters no engine manages) is split evenly over the
data-parallel ranks; with pipeline stages a tensor held by several stages (tied modules) is written
by the first of them. Reading, a rank asks for what it holds: its partitions' ranges, and whole
tensors for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.checkpoint.experts import ExpertNames
from lightning_zero.checkpoint.pieces import Block, FlatPiece
from lightning_zero.comm.compressed import local_comm_state
from lightning_zero.frozen_fp32 import FrozenFp32, even_range
from lightning_zero.parallel.dtensor import local_block, local_tensor
from lightning_zero.zero.engine import ZeroEngine

WEIGHT_PREFIX = "state_dict."


def opt_prefix(k: int) -> str:
    return f"optimizer_states.{k}."


@dataclass
class RankView:
    """What one rank holds, as the checkpoint code needs it (built by the strategy)."""

    module: torch.nn.Module
    optimizers: list[Optimizer]
    engines: list[Optional[ZeroEngine]]
    """One per optimizer (None: a plain optimizer no engine wraps)."""
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    global_rank: int = 0
    orig_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    experts: Optional[ExpertNames] = None
    """Expert parallelism: the renaming of expert tensors to global expert indices (None: none)."""
    edp_rank: int = 0
    edp_size: int = 1
    """This rank among the ranks holding the same experts, and their number (used with ``experts``)."""
    frozen: Optional[FrozenFp32] = None
    """Exact fp32 shares of frozen parameters the cast layout computes in 16 bits (None: none kept)."""
    _memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The name maps below, computed once per view: a view serves one save or load, during which the
    module's names and tensors do not change; an async save's caller waits for them (async_stage.py)."""

    def __post_init__(self) -> None:
        if self.experts is not None:  # the strategy's dtypes are keyed by the module's own names
            self.orig_dtypes = {self.experts.stored(k): v for k, v in self.orig_dtypes.items()}

    def _once(self, key: str, make: Any) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def named_tensors(self) -> dict[str, Tensor]:
        """The module's state-dict entries under their stored names (experts by global index). Shared: not
        to be mutated."""
        def make() -> dict[str, Tensor]:
            state = self.module.state_dict(keep_vars=True)
            if self.experts is None:
                return dict(state)
            return {self.experts.stored(k): v for k, v in state.items()}

        return self._once("named", make)

    def all_names(self) -> list[str]:
        """The stored names of every rank's entries (this rank's, plus the other EP ranks' experts)."""
        return self.every_rank(list(self.named_tensors()))

    def every_rank(self, names: list[str]) -> list[str]:
        """Stored ``names`` of this rank -> every EP rank's, in the single-process order (experts.py
        [Note: experts in sharded checkpoints])."""
        return names if self.experts is None else [n for n, _, _ in self.experts.expand(names)]

    def share(self, name: str) -> tuple[int, int]:
        """(rank, ranks) over which a tensor held whole by several ranks is split when written: the
        expert-data-parallel ranks for an expert's, the data-parallel ranks otherwise."""
        if self.experts is not None and self.experts.is_expert(name):
            return self.edp_rank, self.edp_size
        return self.dp_rank, self.dp_size

    def canonical_names(self) -> dict[str, str]:
        """Every state-dict name -> the first name of the same tensor (tied weights share it)."""
        def make() -> dict[str, str]:
            first: dict[int, str] = {}
            return {name: first.setdefault(id(t), name) for name, t in self.named_tensors().items()}

        return self._once("canonical", make)

    def param_names(self) -> dict[int, str]:
        def make() -> dict[int, str]:
            first: dict[int, str] = {}
            for name, t in self.named_tensors().items():
                first.setdefault(id(t), name)
            return first

        return self._once("params", make)

    def managed(self) -> dict[int, tuple[Any, int]]:
        """id(param) -> (param group storage, slot position) for every parameter an engine holds."""
        def make() -> dict[int, tuple[Any, int]]:
            out: dict[int, tuple[Any, int]] = {}
            for engine in self.engines:
                if engine is None:
                    continue
                for fg in engine.all_groups:
                    for si, slot in enumerate(fg.layout.slots):
                        out.setdefault(id(fg.params[slot.index]), (fg, si))
            return out

        return self._once("managed", make)


def tensor_block(t: Tensor) -> Block:
    """Where this rank's piece of ``t`` lies in the global tensor (a DTensor's TP shard; else all of it)."""
    shape, offset = local_block(t)
    return Block(shape, offset, tuple(t.shape))


def make_piece(source: Tensor, start: int, block: Block) -> FlatPiece:
    """A piece of a rank's block to write: a TP-sharded tensor's in the global n-D shape, any other
    tensor's flattened (pieces.py [Note: tensor-parallel pieces])."""
    if block.is_whole:
        return FlatPiece(source, start, block.numel)
    return FlatPiece(source, start, block.numel, block, nd=True)


def read_piece(source: Tensor, start: int, block: Block) -> FlatPiece:
    """A piece of a rank's block to read; the caller adapts it to the stored form (``stored_as``)."""
    return FlatPiece(source, start, block.numel, block)


def slot_pieces(fg: Any, si: int, dp_rank: int, dp_size: int, whole: bool) -> list[tuple[int, int, int]]:
    """(start in the parameter, start in ``fg.master``, length) of slot ``si``'s elements this rank
    handles: its partition's piece when the group is sharded; otherwise its even share (``whole``
    False: writing) or everything (``whole`` True: reading)."""
    slot = fg.layout.slots[si]
    if fg.layout.num_shards > 1:
        cache = fg.__dict__.setdefault("_ckpt_pieces", None)
        if cache is None:
            cache = {}
            for index, start, shard_start, length in fg.layout.param_pieces_in_shard(fg.shard):
                cache.setdefault(index, []).append((start, shard_start, length))
            fg._ckpt_pieces = cache
        pieces = list(cache.get(slot.index, []))
        assert len(pieces) <= 1, "a parameter lies in one bucket, so its piece of a shard is contiguous"
        return pieces
    lo, hi = (0, slot.numel) if whole else even_range(slot.numel, dp_rank, dp_size)
    return [(lo, slot.offset + lo, hi - lo)] if hi > lo else []


def _flat_view(t: Tensor) -> Optional[Tensor]:
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else None


def _own_weights(view: RankView, whole: bool) -> Iterator[tuple[str, Tensor, Optional[tuple[Tensor, int]]]]:
    """(key, tensor, piece) for every weight and buffer stored under its own (first) name: ``piece`` is
    (master slice, start in the parameter's local block) for a parameter an engine holds, None for
    everything else. ``tensor``: the module's (a DTensor under tensor parallelism)."""
    managed = view.managed()
    canon = view.canonical_names()
    for name, t in view.named_tensors().items():
        if canon[name] != name or not torch.is_tensor(t) or t.numel() == 0:
            continue
        piece = None
        if view.frozen is not None and view.frozen.holds(t):  # its fp32 share: weight_entries/destinations
            yield WEIGHT_PREFIX + name, t, None
            continue
        if id(t) in managed:
            fg, si = managed[id(t)]
            for start, mstart, length in slot_pieces(fg, si, *view.share(name), whole=whole):
                piece = (fg.master[mstart : mstart + length], start)
            if piece is None:
                continue  # this rank holds none of it
        yield WEIGHT_PREFIX + name, t, piece


# ------------------------------------------------------------------------------------------ save
def weight_entries(view: RankView) -> dict[str, Any]:
    """This rank's share of the weights and buffers: ``state_dict.<name>`` -> FlatPiece."""
    out: dict[str, Any] = {}
    for key, t, piece in _own_weights(view, whole=False):
        block = tensor_block(t)
        if piece is not None:
            out[key] = make_piece(piece[0], piece[1], block)
            continue
        if view.frozen is not None and view.frozen.holds(t):
            start, values = view.frozen.piece(t)
            if values.numel():
                out[key] = make_piece(values, start, block)
            continue
        lo, hi = even_range(block.numel, *view.share(key[len(WEIGHT_PREFIX):]))
        if hi > lo:
            local = local_tensor(t)
            flat = _flat_view(local)
            flat = flat if flat is not None else local.detach().reshape(-1)
            out[key] = make_piece(flat[lo:hi], lo, block)
    return out


def _is_flat_state(value: Any, fg: Any) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == fg.master.numel() and value.numel() > 0


def optimizer_entries(view: RankView, k: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Optimizer ``k``'s state this rank writes, and its param groups' records (hyper-parameters,
    parameter names, which state keys are flat) for ``meta.pt``. A param group may own several flat
    groups (expert parallelism: zero/shard_comm.py [Note: expert parameters under ZeRO])."""
    opt, engine = view.optimizers[k], view.engines[k]
    if engine is None:
        raise RuntimeError(
            f"optimizer {k} ({type(opt).__name__}) is not wrapped by a ZeRO engine; sharded checkpoints need every "
            "optimizer set up by the strategy (use checkpoint_format='full')."
        )
    names = view.param_names()
    prefix = opt_prefix(k)
    out: dict[str, Any] = {}
    records = [{
        "hyper": {key: v for key, v in pg.items() if key != "params"},
        "params": view.every_rank([names.get(id(p), "") for p in engine.original_params[pi]]),
        "flat": [],
        "scalar": [],
    } for pi, pg in enumerate(opt.param_groups)]
    for gi, (fg, pi) in enumerate(zip(engine.groups, engine.pg_of)):
        st = opt.state.get(fg.master, {})
        lag = engine.used.lag[gi] if engine.used.lagging[gi] else None  # zero/state_dict.py [Note: per-parameter
        # step counts in checkpoints]
        flat_keys = sorted(key for key, v in st.items() if _is_flat_state(v, fg))
        scalar_keys = sorted(key for key in st if key not in flat_keys)
        rec = records[pi]
        rec["flat"] = sorted(set(rec["flat"]) | set(flat_keys))
        rec["scalar"] = sorted(set(rec["scalar"]) | set(scalar_keys))
        for si, slot in enumerate(fg.layout.slots):
            p = fg.params[slot.index]
            pname = names.get(id(p))
            if pname is None:
                continue
            pieces = slot_pieces(fg, si, *view.share(pname), whole=False)
            block = tensor_block(p)
            for key in flat_keys:
                for start, mstart, length in pieces:
                    out[f"{prefix}state.{pname}.{key}"] = make_piece(st[key][mstart : mstart + length], start, block)
            if any(start == 0 for start, _, _ in pieces):  # the owner of the first element writes the scalars
                for key in scalar_keys:
                    value = st[key]
                    if key == "step" and lag is not None:
                        value = value - lag[slot.index]
                    out[f"{prefix}state.{pname}.{key}"] = value.detach() if torch.is_tensor(value) else value
    comm = local_comm_state(opt)
    if comm is not None:
        out[f"{prefix}comm.rank{view.global_rank}"] = comm
    return out, records


def weight_info(view: RankView) -> dict[str, dict[str, Any]]:
    """Every state-dict name -> shape, dtype to restore, and the key its value is stored under."""
    canon = view.canonical_names()
    tensors = view.named_tensors()
    info = {}
    for name, t in tensors.items():
        if torch.is_tensor(t):
            dtype = view.orig_dtypes.get(name, t.dtype)
            info[name] = {"shape": tuple(t.shape), "dtype": str(dtype).replace("torch.", ""),
                          "key": WEIGHT_PREFIX + canon[name]}
        else:
            info[name] = {"value": t}
    if view.experts is None:
        return info
    out = {}  # the other EP ranks' experts: the same shapes under their global indices
    for name, mine, ep_rank in view.experts.expand(list(tensors)):
        entry = dict(info[mine])
        if "key" in entry and ep_rank is not None:
            entry["key"] = WEIGHT_PREFIX + view.experts.on_rank(canon[mine], ep_rank)
        out[name] = entry
    return out


def drop_later_stage_copies(entries: dict[str, Any], mine: int, first_stage: dict[str, int]) -> dict[str, Any]:
    """Pipeline: keep only the entries whose first holder (``first_stage[key]``) is this stage."""
    return {k: v for k, v in entries.items() if first_stage.get(k, mine) == mine}


# ------------------------------------------------------------------------------------------ load
def weight_destinations(view: RankView) -> tuple[dict[str, Any], list[tuple[Tensor, Tensor]]]:
    """Where this rank reads each weight: ``state_dict.<name>`` -> FlatPiece(s) into the masters it
    holds or the module's own tensors. Returns also (temporary, target) pairs to copy afterwards
    (non-contiguous tensors). One key holds one piece: a rank's partition of a parameter is contiguous."""
    out: dict[str, Any] = {}
    after: list[tuple[Tensor, Tensor]] = []
    managed = view.managed()
    for key, t, piece in _own_weights(view, whole=True):
        block = tensor_block(t)
        if piece is not None:
            out[key] = read_piece(piece[0], piece[1], block)
            continue
        if view.frozen is not None and view.frozen.holds(t):
            out[key], copies = _frozen_destination(view.frozen, t, block, managed.get(id(t)), view)
            after += copies
            continue
        local = local_tensor(t)
        flat = _flat_view(local)
        if flat is None:
            flat = torch.empty(local.numel(), dtype=local.dtype)
            after.append((flat, local))
        out[key] = read_piece(flat, 0, block)
    return out, after


def _frozen_destination(frozen: FrozenFp32, t: Tensor, block: Block, held: Optional[tuple[Any, int]],
                        view: RankView) -> tuple[FlatPiece, list[tuple[Tensor, Tensor]]]:
    """A frozen fp32 parameter of frozen_fp32.py is read whole in fp32, then copied into this rank's share and
    into the 16-bit copy the forward uses: this rank's part of stage 3's frozen partition (``held``: its group and
    slot; never the parameter itself, which a persistent or gathered unit aliases) or the module's tensor."""
    start, values = frozen.piece(t)
    whole = torch.empty(frozen.shares[id(t)].shape.numel(), dtype=torch.float32)
    copies = [(whole[start : start + values.numel()], values)]
    if held is not None:  # stage 3: its partition (a gathered unit's parameters are refreshed from it after load)
        fg, si = held
        for pstart, mstart, length in slot_pieces(fg, si, view.dp_rank, view.dp_size, whole=True):
            copies.append((whole[pstart : pstart + length], fg.master[mstart : mstart + length]))
    else:
        copies.append((whole, local_tensor(t).detach()))
    return read_piece(whole, 0, block), copies


def iter_group_slots(view: RankView, k: int) -> Iterator[tuple[int, Any, Any, str, list[tuple[int, int, int]]]]:
    """(group index, param group storage, param, name, pieces it holds) for optimizer ``k``."""
    engine = view.engines[k]
    assert engine is not None
    names = view.param_names()
    for gi, fg in enumerate(engine.groups):
        for si, slot in enumerate(fg.layout.slots):
            p = fg.params[slot.index]
            name = names.get(id(p))
            if name is not None:
                yield gi, fg, p, name, slot_pieces(fg, si, view.dp_rank, view.dp_size, whole=True)
