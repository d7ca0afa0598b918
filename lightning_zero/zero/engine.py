"""ZeroEngine: the stage-0 engine (data parallel over flat buckets) and the skeleton every stage shares.

What happens, in order, for one optimizer step (stage files override only the marked steps):

1. ``__init__``: every param group becomes a :class:`FlatParamGroup` (its fp32 master is what the
   optimizer steps, see [Note: the optimizer keeps the model's parameters]); a post-accumulate-grad
   hook goes on every trainable parameter.
2. backward: each hook stashes its gradient (``_stash_grad``, per stage) and marks it ready; a
   bucket whose parameters are all ready is launched (``_launch``, per stage) **in bucket order**.
3. ``post_backward`` (called by the strategy after every backward): buckets still waiting (their
   parameters got no gradient this time) are launched in order with zeros for the missing
   parameters, and every collective is awaited and finalised (``_finalize``, per stage).
4. ``step``: global gradient norm, non-finite check ([Note: non-finite steps]), unscale and clip in
   one multiply, the user's optimizer steps the master, updated parameters are written back
   (``_write_back``, per stage).

[Note: launch in bucket order]
Collectives must be issued in the same order on every rank. Hooks fire in an order that depends on the data (a
parameter unused on one rank never fires there), so a bucket is launched only once it and every bucket before it are
ready; whatever is left is launched by ``post_backward``. Ranks may therefore disagree on *when* a bucket goes,
never on the order, which is why parameters without a gradient in a step need no ``find_unused_parameters`` flag. A
rank that did not use a parameter contributes zeros to its average, as under ddp; a parameter no rank used is not
stepped at all, as torch's optimizers leave a ``grad=None`` parameter (unused.py [Note: parameters unused on every
rank]).

[Note: the optimizer keeps the model's parameters]
The user's ``optimizer.param_groups`` keep listing the model's own parameters: Lightning's ``toggle_optimizer``
flips ``requires_grad`` through them (a GAN's discriminator must not step with the generator's gradients),
schedulers and LR finders edit their hyper-parameters, users read them. Only for the duration of
``optimizer.step()`` does each group list the flat master instead (:meth:`ZeroEngine.masters_in_optimizer`), so
``optimizer.state`` is keyed by the masters. The optimizer's ``zero_grad`` is replaced by
:meth:`ZeroEngine.zero_grad`, which discards what the engine has accumulated (stage 1-3 gradients live in shards,
not in ``param.grad``). The parameter lists are checked before every step: a group added, or a parameter unfrozen,
after setup is an error, not a parameter silently left unstepped.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generator, Optional, Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.comm import collectives as C
from lightning_zero.parallel.dtensor import grad_like, is_tp_sharded, local_grad, local_tensor
from lightning_zero.zero.flat_group import FlatParamGroup
from lightning_zero.zero.loss_scaler import DynamicLossScaler
from lightning_zero.zero.partition import build_layout
from lightning_zero.zero.shard_comm import ShardComm, place_param_groups
from lightning_zero.zero.states16 import DeviceStates16, adapt_loaded_state
from lightning_zero.zero.unused import GroupPlan, UsedParams, planned_masters, set_group_steps
from lightning_zero.zero.wrappable import check_wrappable

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.utils.hooks import RemovableHandle

    from lightning_zero.zero.units import Unit


def squared_norm(t: Tensor) -> Tensor:
    """``sum(t**2)`` in fp32 as a device scalar, in one reading pass: ``t.float().pow(2).sum()`` wrote
    a full-size temporary first (5.2 GB and ~4 ms per step for GPT-1.3B's fp32 gradients on one H100)."""
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


@dataclass
class _Pending:
    """A launched bucket: its collective and what to do once it is done."""

    work: object
    finalize: Callable[[], None]


@dataclass
class _BackwardState:
    """Bookkeeping of one backward pass (reset by ``post_backward``)."""

    ready: list[list[bool]]
    missing: dict[tuple[int, int], int]
    next_launch: int = 0
    pending: list[_Pending] = field(default_factory=list)


class ZeroEngine:
    """Stage 0: replicated master and optimizer, bucketed all-reduce of a flat gradient buffer."""

    stage: int = 0
    keeps_full_grad: bool = True
    """Whether parameters keep full gradients (views into ``flat_grad``) after backward."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dp_group: Optional[C.ProcessGroup],
        compute_dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        norm_groups: Sequence[Optional[C.ProcessGroup]] = (),
        param_names: Optional[dict[int, str]] = None,
        tp_group: Optional[C.ProcessGroup] = None,
        expert_comm: Optional[ShardComm] = None,
        **stage_options: object,
    ) -> None:
        """``tp_group``: the tensor-parallel group when DTensor parameters are TP-sharded (the gradient
        norm sums their squares over it; see [Note: gradient norm under tensor parallelism]).
        ``expert_comm``: with expert parallelism, the ranks holding this rank's experts (shard_comm.py
        [Note: expert parameters under ZeRO]); None: every parameter is data parallel over ``dp_group``."""
        check_wrappable(optimizer, self.stage)
        self.optimizer = optimizer
        self.dp_group = dp_group
        self.dp_size = C.world_size(dp_group)
        self.dp_rank = C.rank(dp_group)
        self.compute_dtype = compute_dtype
        self.device = device
        self.norm_groups = list(norm_groups)
        self.param_names = param_names or {}
        self._grad_norm: Optional[Tensor | float] = None
        self.nonfinite_where: Optional[tuple[int, str]] = None
        """After a step skipped for a non-finite norm: (param group, name) of this rank's first
        non-finite gradient, None when this rank's are finite ([Note: non-finite steps])."""
        self.require_sync = True
        self.reduce_gradients = True
        """False while a compressed optimizer averages momentum itself: gradients stay local (stage 0
        only; see lightning_zero/comm/compressed/protocol.py). Set by the strategy before each step."""
        self.groups: list[FlatParamGroup] = []
        self.frozen_groups: list[FlatParamGroup] = []
        """Partitions of parameters no optimizer steps (stage 3 only, stage3.py [Note: frozen parameters])."""
        self.all_groups: list[FlatParamGroup] = self.groups
        """``groups + frozen_groups``, the index space of unit buckets (below stage 3: ``groups`` itself)."""
        self.step_in_backward = False
        """Set by the strategy before each step: this step's coefficient is known to be 1 before backward,
        so an offloading engine may run its host update during backward (offload/eager.py); others ignore it."""
        self.original_params: list[list[Parameter]] = []
        """Each param group's parameters as the user gave them (torch's state-dict numbering)."""
        self.stage_options = stage_options
        self.tp_group = tp_group
        self.tp_size = C.world_size(tp_group) if tp_group is not None else 1
        self.dp_comm = ShardComm.over(dp_group, stage_options.get("param_group"))  # type: ignore[arg-type]
        self.expert_comm = expert_comm
        self.comms: list[ShardComm] = []
        """Flat group ``gi``'s ranks (shard_comm.py [Note: expert parameters under ZeRO])."""
        self.pg_of: list[int] = []
        """Flat group ``gi``'s optimizer param group."""
        self._build_groups(bucket_numel)
        if not self.comms:  # engines building their groups their own way: one per param group, over dp
            self.comms = [self.dp_comm] * len(self.groups)
            self.pg_of = list(range(len(self.groups)))
        self._replicated = [self._replicated_ranges(fg) for fg in self.groups] if self.tp_size > 1 else []
        self.used = UsedParams(self.groups, self.comms)
        self._plans: Optional[list[Optional[GroupPlan]]] = None
        """This step's plan per flat group (None: every master steps whole; unused.py)."""
        optimizer.state.clear()
        states = stage_options.get("states")
        self.states16: Optional[DeviceStates16] = None
        """16-bit masters and Adam moments (``state_precision``; states16.py), None for fp32 states."""
        if states is not None and states.compact:  # type: ignore[attr-defined]
            self.states16 = DeviceStates16(states, optimizer, self.groups, self.pg_of,  # type: ignore[arg-type]
                                           compute_dtype, self.stage)
        self.launch_order: list[tuple[int, int]] = [
            (gi, b.index) for gi, fg in enumerate(self.groups) for b in fg.layout.buckets
        ]
        self._setup_grad_storage()
        self._bw = self._fresh_backward_state()
        self._managed = {id(p) for fg in self.groups for p in fg.params}
        self._hooks = [
            fg.params[slot.index].register_post_accumulate_grad_hook(self._make_hook(gi, si))
            for gi, fg in enumerate(self.groups)
            for si, slot in enumerate(fg.layout.slots)
        ]

    # ---------------------------------------------------------------- stage-specific steps
    def _trainable_groups(self) -> list[list[Parameter]]:
        """Each param group's trainable parameters, deduplicated; the user's lists are remembered."""
        seen: set[int] = set()
        out = []
        for pg in self.optimizer.param_groups:
            self.original_params.append(list(pg["params"]))
            params: list[Parameter] = []
            for p in pg["params"]:
                if id(p) in seen:
                    if any(p is q for q in params):
                        continue  # listed twice in one group (tied weights): one slot
                    raise ValueError("A parameter appears in two param groups; ZeRO needs each in exactly one.")
                seen.add(id(p))
                if p.requires_grad:
                    params.append(p)
            out.append(params)
        return out

    def _build_groups(self, bucket_numel: int) -> None:
        for pi, comm, params in place_param_groups(self._trainable_groups(), self.dp_comm, self.expert_comm):
            num_shards = comm.size if self.stage >= 1 else 1
            shard = comm.rank if self.stage >= 1 else 0
            layout = build_layout([local_tensor(p).numel() for p in params], num_shards, bucket_numel, align=8)
            fg = FlatParamGroup(params, layout, shard, self.compute_dtype, self.device, **self._group_kwargs())
            if hasattr(self.optimizer, "bind_flat_params"):  # tensor boundaries for per-tensor math (1-bit LAMB)
                self.optimizer.bind_flat_params(fg.master, [(s.offset, s.numel) for s in layout.slots], num_shards > 1)
            self.groups.append(fg)
            self.comms.append(comm)
            self.pg_of.append(pi)

    def _setup_grad_storage(self) -> None:
        for fg in self.groups:
            fg.attach_full_grad(self.compute_dtype)

    def _group_kwargs(self) -> dict[str, object]:
        """Extra arguments of the param-group buffers (offload/engine.py places masters in host memory)."""
        return {}

    def _stash_grad(self, gi: int, si: int, param: Tensor) -> None:
        """Make sure the gradient lives in the flat buffer (user code may have replaced ``.grad``)."""
        fg = self.groups[gi]
        view = fg.grad_view(si)
        if param.grad is view:  # accumulated in place already (every backward after the step's first)
            return
        grad = local_grad(param, param.grad) if param.grad is not None else None
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.add_(grad)
        if grad is None or grad.data_ptr() != view.data_ptr():
            param.grad = grad_like(param, view)

    def _launch(self, gi: int, bi: int) -> _Pending:
        fg = self.groups[gi]
        bucket = fg.bucket_view(fg.flat_grad, bi)
        bucket.div_(self.dp_size)  # also for experts: shard_comm.py [Note: expert gradient scale]
        work = C.all_reduce(bucket, self.comms[gi].group, "sum", async_op=True)
        return _Pending(work, lambda: None)

    def _master_grads(self) -> list[Tensor]:
        return [fg.flat_grad if fg.shares_master else fg.flat_grad.to(fg.master.dtype) for fg in self.groups]

    def _write_back(self) -> None:
        for fg in self.groups:
            if not fg.shares_master:
                fg.flat_param.copy_(fg.master)

    def _zero_grads(self) -> None:
        self.used.reset()
        for fg in self.groups:
            fg.flat_grad.zero_()

    @property
    def _grads_are_sharded(self) -> bool:
        return False

    # ---------------------------------------------------------------- hooks and backward
    @property
    def _syncing(self) -> bool:
        """Reduce in this backward? Engines without full gradients must, even while accumulating."""
        return self.reduce_gradients and (self.require_sync or not self.keeps_full_grad)

    def _fresh_backward_state(self) -> _BackwardState:
        missing = {}
        for gi, fg in enumerate(self.groups):
            for b in fg.layout.buckets:
                missing[(gi, b.index)] = len(b.slots)
        return _BackwardState([[False] * len(fg.layout.slots) for fg in self.groups], missing)

    def _make_hook(self, gi: int, si: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._on_grad_ready(gi, si, param)

        return hook

    def _on_grad_ready(self, gi: int, si: int, param: Tensor) -> None:
        bw = self._bw
        slot = self.groups[gi].layout.slots[si]
        if bw.ready[gi][si] and self.launch_order.index((gi, slot.bucket)) < bw.next_launch:
            name = self.param_names.get(id(param), f"group {gi} parameter {slot.index}")
            raise RuntimeError(
                f"Parameter '{name}' received a second gradient after its bucket was reduced in this "
                "backward pass (reentrant activation checkpointing does this): use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        self._stash_grad(gi, si, param)
        self.used.mark(gi, slot.index)
        if not self._syncing or bw.ready[gi][si]:
            return
        bw.ready[gi][si] = True
        bw.missing[(gi, slot.bucket)] -= 1
        while bw.next_launch < len(self.launch_order) and bw.missing[self.launch_order[bw.next_launch]] == 0:
            gb = self.launch_order[bw.next_launch]
            bw.pending.append(self._launch(*gb))
            bw.next_launch += 1

    def post_backward(self) -> None:
        """Finish the reduction of this backward pass (no-op while gradients accumulate locally, or
        when no parameter of this engine could receive a gradient: another optimizer's toggled step)."""
        if not self._syncing or self._nothing_to_reduce():
            return
        bw = self._bw
        while bw.next_launch < len(self.launch_order):
            bw.pending.append(self._launch(*self.launch_order[bw.next_launch]))
            bw.next_launch += 1
        for p in bw.pending:
            p.work.wait()
            p.finalize()
        self._bw = self._fresh_backward_state()

    def _nothing_to_reduce(self) -> bool:
        """No gradient arrived and none could (every parameter has ``requires_grad=False``, e.g. another
        optimizer is toggled): the same on every rank, since the program sets ``requires_grad``."""
        bw = self._bw
        if bw.next_launch or any(any(r) for r in bw.ready):
            return False
        return not any(p.requires_grad for fg in self.groups for p in fg.params)

    # ---------------------------------------------------------------- the user's optimizer
    @contextmanager
    def masters_in_optimizer(self) -> Generator[None, None, None]:
        """Each param group lists its flat master while the block runs ([Note: the optimizer keeps ...])."""
        groups = self.optimizer.param_groups
        saved = [pg["params"] for pg in groups]
        for pi, pg in enumerate(groups):
            pg["params"] = [fg.master for fg, owner in zip(self.groups, self.pg_of) if owner == pi]
        try:
            yield
        finally:
            for pg, params in zip(groups, saved):
                pg["params"] = params

    def check_param_groups(self) -> None:
        """Refuse a step whose param groups changed since setup in a way the partition cannot follow."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.original_params):
            raise RuntimeError(
                f"{type(self.optimizer).__name__} has {len(groups)} param groups, but had {len(self.original_params)} "
                "when the ZeRO strategy set up: add param groups in configure_optimizers, before fit starts."
            )
        for gi, (pg, params) in enumerate(zip(groups, self.original_params)):
            if len(pg["params"]) != len(params) or any(p is not q for p, q in zip(pg["params"], params)):
                raise RuntimeError(
                    f"The parameters of param group {gi} of {type(self.optimizer).__name__} changed after the ZeRO "
                    "strategy set up; it partitioned them then. Build the param groups in configure_optimizers."
                )
            for p in params:
                if id(p) not in self._managed and p.grad is not None:
                    name = self.param_names.get(id(p), f"a parameter of param group {gi}")
                    raise RuntimeError(
                        f"'{name}' was frozen (requires_grad=False) when the ZeRO strategy set up, so it has no "
                        "partition, but now has a gradient. Set requires_grad before fit (e.g. in "
                        "configure_model or __init__), not during training."
                    )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``: drop the engine's gradients, clear the unmanaged ``.grad``s;
        ``set_to_none=False`` keeps what was used stepping, as torch does (unused.py [Note: zero_grad(set_to_none=
        False)])."""
        self._zero_grads()
        self.used.keep_grads(not set_to_none)
        for pg in self.optimizer.param_groups:
            for p in pg["params"]:
                if id(p) in self._managed or p.grad is None:
                    continue
                p.grad = None if set_to_none else p.grad.detach_().zero_()

    # ---------------------------------------------------------------- the step
    # [Note: gradient norm under tensor parallelism]
    # Under TP a rank's flat gradients hold two kinds of elements: pieces of TP-sharded parameters
    # (each tp rank a different piece: their squares must be summed over tp) and replicated parameters
    # (the same values on every tp rank: counted once). Weighting the replicated elements' squares by
    # 1/tp and summing over the tp group does both in the one scalar all-reduce the other dims use.
    def _replicated_ranges(self, fg: FlatParamGroup) -> list[tuple[int, int]]:
        """[start, end) ranges of replicated parameters' elements in ``fg``'s step gradients (the full
        flat buffer at stage 0, this rank's shard above), merged where adjacent."""
        shard = fg.shard if fg.layout.num_shards > 1 else 0
        ranges: list[tuple[int, int]] = []
        for index, _, start, length in sorted(fg.layout.param_pieces_in_shard(shard), key=lambda t: t[2]):
            if is_tp_sharded(fg.params[index]):
                continue
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + length)
            else:
                ranges.append((start, start + length))
        return ranges

    def global_grad_norm_sq(self, grads: Sequence[Tensor]) -> Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated_experts = self.expert_comm is not None and not self._grads_are_sharded
        for gi, g in enumerate(grads):
            if g.numel():  # stage 0 with experts: each group's squares over its replicas ([Note: gradient norm with experts])
                sq += squared_norm(g) / (self.comms[gi].size if replicated_experts else 1)
            if self.tp_size > 1:  # [Note: gradient norm under tensor parallelism]
                for a, b in self._replicated[gi]:
                    sq -= (1.0 - 1.0 / self.tp_size) * squared_norm(g[a:b])
        return self._reduce_grad_sq(sq)

    def _reduce_grad_sq(self, sq: Tensor) -> Tensor:
        """This rank's squared gradient norm (replicated TP elements already weighted by 1/tp) summed over
        every dim that splits the gradients; offload (offload/engine.py) sums its own squares, then this."""
        replicated_experts = self.expert_comm is not None and not self._grads_are_sharded
        local = not self.reduce_gradients  # un-averaged local gradients: use the mean of the ranks' squares
        groups = ([self.dp_group] if self._grads_are_sharded or local or replicated_experts else []) + self.norm_groups
        groups += [self.tp_group] if self.tp_size > 1 else []
        for grp in groups:
            C.all_reduce(sq, grp, "sum")
        return sq / self.dp_size if local else sq

    # [Note: the norm is read lazily]
    # The global gradient norm is computed every step (a device scalar: one reading pass and one scalar
    # all-reduce), but turned into a Python float only when something needs its value: clipping and
    # the fp16 overflow check at once, logging when it reads ``grad_norm``. A float at every step
    # would make the CPU wait for the end of backward before it could queue the step, leaving the
    # GPU idle while the step and the next forward are launched.
    @property
    def grad_norm(self) -> Optional[float]:
        """Global gradient norm (unscaled, before clipping) of the last step."""
        if isinstance(self._grad_norm, Tensor):
            self._grad_norm = float(self._grad_norm)
        return self._grad_norm

    @grad_norm.setter
    def grad_norm(self, value: Optional[float]) -> None:
        self._grad_norm = value

    # [Note: non-finite steps]
    # A NaN or infinite gradient anywhere makes the global norm non-finite on every rank alike (it is all-reduced),
    # so the norm the step computes anyway is the check: no extra pass, no collective. Deciding needs its value on
    # the host before the optimizer runs, the one synchronisation fp16's overflow check (and clipping) already made;
    # ``check_finite`` asks for it at every precision. A skipped step touches nothing: the optimizer is not called
    # (no moment update, no step count, no weight decay), the masters and 16-bit weights are not written, the
    # gradients are dropped. Only then, on that rare path, is the first non-finite gradient looked for
    # (``nonfinite_where``, this rank's shard only: engines.py gathers the ranks' findings to name it). The policy
    # (skip, error, ignore; how many skips in a row) is engines.py's ``Engines.step``.
    def step(self, clip_val: Optional[float] = None, scaler: Optional[DynamicLossScaler] = None,
             check_finite: bool = False, clip_value: Optional[float] = None) -> bool:
        """Unscale, clip by the global norm (``clip_val``) or each element (``clip_value``), step the master
        shard, write back. False when skipped: an fp16 overflow, or with ``check_finite`` any non-finite norm."""
        self.check_param_groups()
        grads = self._master_grads()
        scale = scaler.scale if scaler is not None else 1.0
        self._grad_norm = self.global_grad_norm_sq(grads).sqrt() / scale  # [Note: the norm is read lazily]
        self.nonfinite_where = None
        if scaler is not None or check_finite:
            finite = math.isfinite(self.grad_norm)  # type: ignore[arg-type]
            if scaler is not None:
                scaler.update(not finite)
            if not finite:
                if check_finite:
                    self.nonfinite_where = self._first_nonfinite(grads)
                self._zero_grads()
                return False
        coef = 1.0 / scale
        if clip_value is not None and clip_value > 0:  # precision.py [Note: clipping by value]
            for g in grads:
                g.mul_(coef).clamp_(-clip_value, clip_value)
            coef = 1.0
        elif clip_val is not None and clip_val > 0:
            coef *= min(1.0, clip_val / (self.grad_norm + 1e-6))  # type: ignore[operator]
        self._plans = self.used.plan(self.optimizer, self.device, self._step_counted)  # collective: unused.py
        self._step_masters(grads, coef)
        self._plans = None
        self._write_back()
        self._zero_grads()
        return True

    def _first_nonfinite(self, grads: Sequence[Tensor]) -> Optional[tuple[int, str]]:
        """(optimizer param group, parameter name) of the first non-finite gradient in this rank's
        gradients (shards above stage 0), or None: all finite here. Reads each suspect on the host:
        called only after a non-finite norm."""
        for gi, g in enumerate(grads):
            if not g.numel() or bool(torch.isfinite(torch.linalg.vector_norm(g, ord=math.inf))):
                continue
            fg = self.groups[gi]
            shard = fg.shard if fg.layout.num_shards > 1 else 0
            for index, _, start, length in sorted(fg.layout.param_pieces_in_shard(shard), key=lambda t: t[2]):
                piece = g[start : min(start + length, g.numel())]
                if piece.numel() and not bool(torch.isfinite(torch.linalg.vector_norm(piece, ord=math.inf))):
                    param = fg.params[index]
                    return self.pg_of[gi], self.param_names.get(id(param), f"parameter {index}")
            return self.pg_of[gi], "?"
        return None

    @property
    def _step_counted(self) -> bool:
        """Whether the optimizer state's ``step`` already counts this step (offload's step during backward)."""
        return False

    def _step_masters(self, grads: list[Tensor], coef: float) -> None:
        """Scale the gradients by ``coef`` (unscale and clip) and step the masters (offload: on the CPU)."""
        if self.states16 is not None:  # bf16 states: coef goes into the step (states16.py)
            self.states16.adopt_param_writes()  # flat_group.py [Note: writes outside the optimizer]
            self.states16.step(grads, coef, self._plans)
            return
        for fg, g in zip(self.groups, grads):
            fg.adopt_param_writes()  # flat_group.py [Note: writes outside the optimizer]
            if coef != 1.0:
                g.mul_(coef)
            fg.master.grad = g
        if self._plans is not None:  # some parameter unused on every rank (unused.py)
            masters = [fg.master for fg in self.groups]
            with planned_masters(self.optimizer, masters, self.pg_of, grads, self._plans):
                self.optimizer.step()
            set_group_steps(self.optimizer, masters, self._plans)
        else:
            with self.masters_in_optimizer():
                self.optimizer.step()
        for fg in self.groups:
            fg.master.grad = None

    def after_master_load(self) -> None:
        """Masters were overwritten (checkpoint load): the 16-bit parameters follow them (stages 1-2
        all-gather them from the masters' shards)."""
        self._masters_replaced()
        self._write_back()

    def _masters_replaced(self) -> None:
        """A Kahan word belongs to the master it compensated: new masters start without one (a loaded optimizer
        state brings its own next: states16.py ``adapt_loaded_state``)."""
        if self.states16 is not None:
            self.states16.masters_replaced()

    def after_state_load(self) -> None:
        """An optimizer state was loaded into ``optimizer.state`` (inside ``host_state``): bring it into this
        engine's state layout (states16.py ``adapt_loaded_state``: a checkpoint of 16-bit states loads into
        fp32 states and the other way round)."""
        adapt_loaded_state(self)

    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        """Masters and optimizer state readable and writable inside the block. A no-op here; NVMe
        offload swaps them in and back out (checkpoints go through this: zero/state_dict.py)."""
        yield

    def teardown(self) -> None:
        """End of a fit/validate/test (the engine stays for later checkpoints); offload finishes its
        delayed step and releases swap files here."""

    def abandon(self) -> None:
        """Teardown after a failure: no collective (a peer may be gone), nothing kept."""
        self.remove_hooks()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---------------------------------------------------------------- events every engine gets
    # [Note: events, not engine classes]
    # Engines (engines.py) sends every engine the same events; those that mean nothing to an engine are
    # no-ops here, and stage3.py / offload/ override them (the offload engines' ``swap_dir``). So nobody
    # outside zero/ and offload/ asks which engine class it holds (tests/unit/test_structure.py checks).
    def inner_units(self) -> Optional[list["Unit"]]:
        """The units below the root that gather their parameters (stage 3); None: this engine has none."""
        return None

    def begin_step(self) -> None:
        """A training, validation, test or predict step starts (stage 3 gathers its root unit)."""

    def end_eval_step(self) -> None:
        """An evaluation step ended (stage 3 releases what it gathered)."""

    @contextmanager
    def gathered_params(self, module: Optional["Module"] = None, writeback: bool = False) -> Generator[None, None, None]:
        """Full parameters inside (below stage 3 they always are); ``writeback``: changes reach the masters now."""
        yield
        for fg in self.groups if writeback else []:
            fg.adopt_param_writes(self.states16.compensation(fg) if self.states16 is not None else None)

    def install_module_hooks(self) -> None:
        """Validate/test/predict after fit: forward hooks back on (stage 3 gathers unit by unit)."""

    def unshard_to_plain(self) -> None:
        """A second setup: parameters get their full storage back (stage 3; collective there)."""

    def guard_released(self, module: "Module") -> list["RemovableHandle"]:
        """After teardown: hooks that make a call of a released module fail naming the fix (stage 3)."""
        return []

    def swap_dir(self) -> Optional[str]:
        """This rank's NVMe swap directory (offload to NVMe), removed when a peer failed."""
        return None

    # ---------------------------------------------------------------- inspection
    def param_shards(self, trainable: bool = True, frozen: bool = True) -> list[Tensor]:
        """The storage of this rank's parameters (stages 0-2: the full 16-bit buffers)."""
        return [fg.flat_param for fg in self.groups] if trainable else []

    def sharded_params(self) -> list[Parameter]:
        """Parameters whose storage is released between uses (stage 3 only)."""
        return []

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank's parameter gathers and gradient reductions have sent so far, by label (stage 3
        counts them: zeropp.py); empty here."""
        return {}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (for memory reports)."""
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total
