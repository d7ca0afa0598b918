"""Stage 3: parameters are partitioned too; each unit is gathered just before it runs.

What is new over stage 2 (stage2.py), in the order it happens:

* layout: one bucket per (unit, param group) instead of size-capped buckets (units.py says what a
  unit is), so a unit's gather and its gradient reduce-scatter are one collective per group;
* ``begin_step``: the root unit (embeddings, tied head, final norm) and the resident units (read
  outside their forward, read_watch.py) are gathered for the whole step;
* forward pre-hook of a unit: gather it (waiting for a prefetch if one is in flight), then prefetch
  the next ``prefetch_units`` units of the recorded order while this one computes; forward
  post-hook: release it, and hook its outputs so it is gathered again when backward reaches it;
* backward: gradients are reduce-scattered by stage 2's bucket logic; once every parameter of a unit
  has its gradient, the unit is released; ``post_backward`` releases whatever is left;
* step: the fp32 master shard steps; the 16-bit shard is refreshed from it; nothing is all-gathered
  (the next forward gathers), except persistent units, which stay gathered and are refreshed here.

Tensor parallelism: as under stages 1 and 2, a DTensor parameter's local TP shard is what a unit's
buckets flatten, partition over the data-parallel ranks, gather and release (parallel/dtensor.py
[Note: ZeRO sees the local TP shard]); a TP model built on the meta device is materialised like any
other, shard by shard (materialize.py).

[Note: frozen parameters]
Parameters no optimizer steps (``requires_grad=False``, or in no optimizer: the frozen base of a LoRA
fine-tune) are partitioned and gathered with their unit like the others, in extra
:class:`ShardedParamGroup` s of one engine (``frozen_groups``; the strategy gives them to its first
engine), one per dtype (fp32 weights in the compute dtype, others as built), whose only shard is in that
dtype: no fp32 master, no gradient buffer, no optimizer state. Their unit buckets index
``all_groups = groups + frozen_groups``; everything that steps or reduces loops over ``groups`` only. Several
optimizers mean several engines over the same units, each gathering its own buckets in the same hooks. A unit
with frozen weights cannot be released when its trainable gradients are in (a LoRA adapter's gradient is ready
before the frozen base weight has computed the gradient of the unit's input): its inputs pass through an identity
autograd function whose backward releases it, once every input gradient is computed.

[Note: two process groups]
Parameter all-gathers run on their own data-parallel group. Gradient buckets launch in bucket order
(engine.py's [Note: launch in bucket order]) and gathers in execution order; on one group their
interleaving could differ between ranks (a hook firing earlier on one rank), which mismatches
collectives. Two groups keep each ordering consistent and let NCCL overlap the two streams.

[Note: activation checkpointing]
Under ``torch.utils.checkpoint`` a unit's forward runs again inside backward. Its pre-hook then
gathers (if the backward pre-hook has not already) and its post-hook must not release: the
recomputed activations are consumed by the backward that follows. ``_in_backward`` tells these apart.

ZeRO++ (quantized gathers and reductions, hpZ's secondary copies) goes through ``self.zpp``, which also
counts every gather's and reduction's bytes: zeropp.py [Note: ZeRO++ in stage 3].
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.nn import Parameter

from lightning_zero.comm.traffic import Traffic
from lightning_zero.config.quantization import QuantCommConfig
from lightning_zero.config.stage3 import Stage3Config
from lightning_zero.parallel.dtensor import local_tensor, point_local
from lightning_zero.zero.engine import _Pending
from lightning_zero.zero.first_step import check_same_unit
from lightning_zero.zero.inplace_guard import InPlaceGuard
from lightning_zero.zero.partition import build_grouped_layout
from lightning_zero.zero.released_guard import guard_released_modules
from lightning_zero.zero.shard_comm import is_expert, place_param_groups
from lightning_zero.zero.sharded_group import ShardedParamGroup
from lightning_zero.zero.stage2 import Stage2Engine
from lightning_zero.zero.units import ROOT, Unit, assign_params, find_units
from lightning_zero.zero.zeropp import ZeroPP


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _outside_compile(hook: Any) -> Any:
    """A unit hook that torch.compile never traces ([Note: hooks outside compiled regions] in compile.py)."""
    return torch._dynamo.disable(hook, recursive=True)


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


def _drop_grad(param: Tensor) -> None:
    param.grad = None


class _BackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of all of them are computed."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: Tensor) -> Any:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


def _after_unit_backward(args: tuple, kwargs: dict, callback: Any) -> Optional[tuple[tuple, dict]]:
    """``args``/``kwargs`` with their grad-requiring tensors passed through :class:`_BackwardDone`."""
    flat = list(args) + list(kwargs.values())
    picks = [i for i, a in enumerate(flat) if isinstance(a, Tensor) and a.requires_grad]
    if not picks:
        return None
    outs = _BackwardDone.apply(callback, *[flat[i] for i in picks])
    for i, out in zip(picks, outs):
        flat[i] = out
    return tuple(flat[: len(args)]), dict(zip(kwargs.keys(), flat[len(args) :]))


class Stage3Engine(Stage2Engine):
    stage = 3

    records_order_without_grad = False
    """Record the prefetch order in forwards without autograd too (inference/engine.py, which has no
    backward to learn it from); training engines learn it from the first training step only."""

    def _frozen_group_kwargs(self, dtype: torch.dtype) -> dict[str, object]:
        """Arguments of a frozen partition's :class:`ShardedParamGroup` ([Note: frozen parameters]): one shard
        in ``dtype`` (:meth:`_frozen_dtype`) on the device (inference/engine.py may place it in host memory)."""
        return {"master_dtype": dtype}

    def _frozen_dtype(self, p: Parameter) -> torch.dtype:
        """What a frozen parameter is gathered in: fp32 ones in the compute dtype (the cast layout's 16 bits), any
        other dtype as the user built it. A bf16 base under ``32-true`` came back in fp32 and the user's own
        ``base(x.bfloat16())`` failed with a dtype mismatch; ddp computes it in bf16."""
        return self.compute_dtype if p.dtype == torch.float32 else p.dtype

    # ---------------------------------------------------------------- construction
    def _build_groups(self, bucket_numel: int) -> None:
        opts = self.stage_options
        module: nn.Module = opts["module"]  # type: ignore[assignment]
        self.param_group = opts.get("param_group", self.dp_group)
        cfg: Stage3Config = opts["stage3"]  # type: ignore[assignment]
        self.prefetch_units = int(cfg.prefetch_units)
        self.max_live = int(cfg.max_live_parameters)
        threshold = int(cfg.param_persistence_threshold)
        materialize = opts.get("materialize")
        self.traffic = Traffic()
        """Bytes this rank's gathers and gradient reductions sent, by label (zeropp.py)."""
        quant: QuantCommConfig = opts.get("quant_comm") or QuantCommConfig()  # type: ignore[assignment]
        self.zpp = ZeroPP(quant, opts.get("hpz"), self.traffic)  # type: ignore[arg-type]
        self._secondary_due: dict[int, list] = {}
        """Units gathered in a grad-enabled forward whose hpZ copies are taken once the gather is in."""
        self._inexact: set[int] = set()
        """Gathered units holding quantized (qwZ) values."""
        self.units: list[Unit] = find_units(module, cfg.unit_policy)
        per_group = self._trainable_groups()
        frozen: list[Parameter] = list(opts.get("frozen_params", ()))  # type: ignore[call-overload]
        owner = assign_params(module, self.units, [p for ps in per_group for p in ps] + frozen)
        order = [u.index for u in reversed(self.units[1:])] + [ROOT]  # backward order: last block first
        self.frozen_groups: list[ShardedParamGroup] = []
        """[Note: frozen parameters] partitions of parameters no optimizer steps (index ``len(groups) + i``
        in unit buckets)."""
        if self.expert_comm is not None and any(is_expert(p) for p in frozen):
            raise NotImplementedError("ZeRO-3 with expert_parallel > 1 and frozen expert parameters is not built yet: "
                                      "give every expert parameter to an optimizer, or use stage 1 or 2.")
        placed = place_param_groups(per_group, self.dp_comm, self.expert_comm)  # shard_comm.py [Note: expert ...]
        builds = [(params, self._group_kwargs(), False, comm, pi, self.compute_dtype) for pi, comm, params in placed]
        by_dtype: dict[torch.dtype, list[Parameter]] = {}
        for p in frozen:
            by_dtype.setdefault(self._frozen_dtype(p), []).append(p)
        for dtype, params in by_dtype.items():  # one frozen group per dtype
            builds.append((params, self._frozen_group_kwargs(dtype), True, self.dp_comm, -1, dtype))
        self._gather_groups = [comm.param_group for _, _, _, comm, _, _ in builds]
        """Flat group ``gi``'s parameter-gather group (index as in ``all_groups``)."""
        for gi, (params, kwargs, is_frozen, comm, pi, dtype) in enumerate(builds):
            keys = [owner[id(p)] for p in params]
            sizes = [local_tensor(p).numel() for p in params]  # a DTensor's TP shard (parallel/dtensor.py)
            layout, bucket_of = build_grouped_layout(sizes, keys, order, comm.size, align=8)
            fg = ShardedParamGroup(params, layout, comm.rank, dtype, self.device,
                                   alias=self.single_rank_shortcuts, **kwargs)
            if not is_frozen:
                self.comms.append(comm)
                self.pg_of.append(pi)
            for key, bi in bucket_of.items():
                unit = self.units[key]
                unit.buckets.append((gi, bi))
                unit.numel += layout.buckets[bi].data_end - layout.buckets[bi].start
                unit.params += [params[layout.slots[si].index] for si in layout.buckets[bi].slots]
            (self.frozen_groups if is_frozen else self.groups).append(fg)
        self.all_groups: list[ShardedParamGroup] = self.groups + self.frozen_groups  # type: ignore[operator]
        for unit in self.units:  # unit by unit: a meta-built model is materialised one unit at a time
            if materialize is not None:
                materialize(unit, self.units)  # type: ignore[operator]
            for gi, bi in unit.buckets:
                self.all_groups[gi].adopt(bi)
            unit.persistent = not unit.is_root and unit.numel <= threshold
        self._frozen_units = {u.index for u in self.units if any(gi >= len(self.groups) for gi, _ in u.buckets)}
        """Units holding frozen weights: released after their input gradients, not their own ([Note: frozen ...])."""
        self._frozen_grad_hooks = [  # trainable but in no optimizer: never stepped, so its gradient is dropped
            p.register_post_accumulate_grad_hook(_drop_grad) for p in frozen if p.requires_grad
        ]
        self._pending: dict[int, list] = {}
        self._gathered: set[int] = set()
        self._inplace = InPlaceGuard(self.param_names)  # [Note: in-place writes outside the optimizer]
        self._grads_left: dict[int, int] = {}
        self.order: list[int] = []
        self._order_frozen = False
        self._last_pos: dict[int, int] = {}
        self._cursor, self._bw_started = 0, False
        self._bw_cursor = -1
        """Backward's position in the recorded order (counting down; [Note: units skipped on one rank])."""
        self.running: set[int] = set()
        """Units whose forward is executing now (read_watch.py asks)."""
        self.live_numel = self.max_live_units_seen = self.max_live_numel_seen = 0
        self.released_by_step = False
        """From a step's write-back to the next step's gathers: units hold no values (read_watch.py refuses reads)."""
        self._unit_of_slot = {
            (gi, si): owner[id(fg.params[slot.index])]
            for gi, fg in enumerate(self.groups)
            for si, slot in enumerate(fg.layout.slots)
        }
        self._module_hooks: list = []
        self.install_module_hooks()
        for unit in self.units:
            if unit.persistent:
                self.gather(unit)

    # ---------------------------------------------------------------- gather / release
    def gather(self, unit: Unit, wait: bool = True, exact: bool = False) -> None:
        """All-gather ``unit`` (collective on the parameter group; every rank calls it in the same order);
        quantized under qwZ unless ``exact``, from hpZ's copies where forward kept them (zeropp.py)."""
        if unit.index not in self._gathered:
            self._inplace.before_gather(unit)
            works, pieces = [], []
            exact = exact or unit.persistent
            secondary = not exact and self.zpp.has_secondary(unit.index)
            for gi, bi in unit.buckets:
                fg = self.all_groups[gi]
                if fg.aliased:  # sharded_group.py [Note: one rank aliases its partition]
                    continue
                buf = fg.allocate(bi)
                if secondary:
                    works.append(self.zpp.gather_secondary(buf, (gi, bi)))
                else:
                    works.append(self.zpp.gather(buf, self._gather_source(gi, bi), self._gather_groups[gi], exact))
                pieces.append(((gi, bi), buf))
            if (pieces and not exact and not secondary and self.zpp.keeps_secondaries and torch.is_grad_enabled()
                    and not _in_backward() and not unit.held_for_step):
                self._secondary_due[unit.index] = pieces
            if pieces and not exact and self.zpp.weight_bits is not None:
                self._inexact.add(unit.index)
            self._pending[unit.index] = works
            self._gathered.add(unit.index)
            self.live_numel += unit.numel
            live_units = sum(1 for i in self._gathered if not self.units[i].held_for_step and not self.units[i].persistent)
            self.max_live_units_seen = max(self.max_live_units_seen, live_units)
            self.max_live_numel_seen = max(self.max_live_numel_seen, self.live_numel)
        if wait:
            self._wait(unit)

    def _gather_source(self, gi: int, bi: int) -> Tensor:
        """This rank's chunk of bucket ``bi`` on the device (offload/sharded.py copies it from the host)."""
        return self.all_groups[gi].gather_source(bi)

    def _wait(self, unit: Unit) -> None:
        works = self._pending.pop(unit.index, None)
        if works is not None:
            for w in works:
                w.wait()
            self._inplace.gathered(unit)
        due = self._secondary_due.pop(unit.index, None)
        if due is not None:
            self.zpp.keep_secondary(unit.index, due)

    def release(self, unit: Unit, force: bool = False) -> None:
        """Free the unit's full buffers; persistent and resident units only when ``force``d."""
        if unit.index not in self._gathered or ((unit.persistent or unit.resident) and not force):
            return
        self._wait(unit)
        self._inplace.before_release(unit)
        for gi, bi in unit.buckets:
            self.all_groups[gi].free(bi)
        self._gathered.discard(unit.index)
        self._inexact.discard(unit.index)
        self._inplace.released(unit)
        self.live_numel -= unit.numel

    def _prefetch(self, upcoming: Iterable[int]) -> None:
        for idx in upcoming:
            unit = self.units[idx]
            if idx in self._gathered or unit.persistent or unit.held_for_step:
                continue
            if self.live_numel + unit.numel > self.max_live:
                return
            self.gather(unit, wait=False)

    # ---------------------------------------------------------------- hooks
    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if _in_backward():  # recomputation under activation checkpointing
                self.gather(unit)
                return None
            if not self._order_frozen and (torch.is_grad_enabled() or self.records_order_without_grad):
                self.order.append(unit.index)
                self._agree(unit, "forward")
            self.running.add(unit.index)
            if self._order_frozen:
                self._catch_up_forward(unit)
            self.gather(unit)
            if self._order_frozen and self.prefetch_units > 0:
                pos = self._cursor
                if pos < len(self.order) and self.order[pos] == unit.index:
                    self._cursor += 1
                    self._prefetch(self.order[pos + 1 : pos + 1 + self.prefetch_units])
            if unit.index in self._frozen_units and torch.is_grad_enabled():  # see [Note: frozen parameters]
                return _after_unit_backward(args, kwargs, lambda: self._unit_backward_done(unit))
            return None

        return _outside_compile(hook)

    def _agree(self, unit: Unit, where: str) -> None:
        """First step: the ranks agree on the unit before its gather (first_step.py [Note: units skipped in the
        first step]); only where the gather issues a collective (persistent or gathered units issue none)."""
        if unit.buckets and unit.index not in self._gathered and not (unit.persistent or unit.held_for_step):
            check_same_unit(unit.index, self.units, self._gather_groups[unit.buckets[0][0]], self.device, where)

    def _unit_backward_done(self, unit: Unit) -> None:
        """The gradients of a unit's inputs are computed: its backward no longer needs its weights."""
        if not unit.held_for_step:
            self.release(unit)

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if _in_backward():
                return output
            self.running.discard(unit.index)
            if torch.is_grad_enabled():
                tensors = [t for t in _tensors(output) if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self._pre_backward(unit), mode="any"
                    )
            self.release(unit)
            return output

        return _outside_compile(hook)

    def _catch_up_forward(self, unit: Unit) -> None:
        """[Note: units skipped on one rank] Gathers are collectives, so every rank must issue them in
        the same sequence, but data-dependent control flow (a layer skipped, an early exit) can skip a
        unit on one rank only. Gathers follow the recorded order: a unit entered beyond the cursor
        means the units in between were skipped here; each is gathered anyway (a no-op when already
        prefetched, as it usually is) and released, so the sequence of gathers, and which units are
        gathered afterwards, is the one a rank that ran them has. Backward does the same against the
        recorded order reversed (:meth:`_catch_up_backward`). Skipped units cost their gathers."""
        pos = self._cursor
        try:
            nxt = self.order.index(unit.index, pos)
        except ValueError:
            return  # not in the recorded order (a unit used more often than in the first step)
        for skipped in self.order[pos:nxt]:
            other = self.units[skipped]
            if skipped in self.running:
                continue
            self.gather(other)
            self.release(other)
        self._cursor = nxt

    def _catch_up_backward(self, unit: Unit) -> Optional[int]:
        """Backward's side of [Note: units skipped on one rank]: the position of ``unit`` in the
        recorded order, searching down from the backward cursor; units in between are gathered (they
        are released at the end of backward)."""
        hi = self._bw_cursor
        pos = next((i for i in range(min(hi, len(self.order) - 1), -1, -1) if self.order[i] == unit.index), None)
        if pos is None:
            return self._last_pos.get(unit.index)
        for skipped in reversed(self.order[pos + 1 : hi + 1]):
            self.gather(self.units[skipped], wait=False)
        self._bw_cursor = pos - 1
        return pos

    def _pre_backward(self, unit: Unit) -> None:
        if self._order_frozen and not self._bw_started:
            self._bw_started = True
            # a unit prefetched for a forward that skipped it is still gathered on this rank only
            # (every unit that ran was released after its forward): release it so that backward's
            # gathers start from the same state on every rank ([Note: units skipped on one rank])
            for idx in list(self._gathered):
                if not self.units[idx].held_for_step:
                    self.release(self.units[idx])
        pos = self._catch_up_backward(unit) if self._order_frozen else self._agree(unit, "backward")
        self.gather(unit)
        if self._order_frozen and self.prefetch_units > 0 and pos is not None:
            self._prefetch(reversed(self.order[max(0, pos - self.prefetch_units) : pos]))

    def _on_grad_ready(self, gi: int, si: int, param: Tensor) -> None:
        first = not self._bw.ready[gi][si]
        super()._on_grad_ready(gi, si, param)
        if not first:
            return
        idx = self._unit_of_slot[(gi, si)]
        unit = self.units[idx]
        if idx not in self._grads_left:
            self._grads_left[idx] = sum(
                len(self.groups[g].layout.buckets[b].slots) for g, b in unit.buckets if g < len(self.groups)
            )
        self._grads_left[idx] -= 1
        if self._grads_left[idx] == 0 and not unit.held_for_step and idx not in self._frozen_units:
            self.release(unit)  # units holding frozen weights: released by _unit_backward_done

    def _reduce_scatter_into_shard(self, gi: int, bi: int, bucket: Tensor, after: Any = None) -> _Pending:
        """qgZ's quantized reduce-scatter, or stage 1's exact one, counted (zeropp.py)."""
        comm, fg = self.comms[gi], self.groups[gi]
        if not self.zpp.quantizes_gradients or comm.size == 1:
            self.zpp.count_exact_reduce(fg.layout.buckets[bi].chunk, bucket.element_size(), comm.size)
            return super()._reduce_scatter_into_shard(gi, bi, bucket, after)
        # the fp32 sum / dp_size lands in the gradient shard: comm/quantized.py [Note: qgZ into the gradient shard]
        work = self.zpp.start_reduce_scatter(bucket, comm.group, self.dp_size, into=lambda: fg.grad_chunk_to_write(bi))
        return _Pending(work, after if after is not None else lambda: None)

    # ---------------------------------------------------------------- step boundaries
    def inner_units(self) -> Optional[list[Unit]]:
        return self.units[1:]

    def guard_released(self, module: nn.Module) -> list:
        self.end_eval_step()
        return guard_released_modules(module, self)

    def begin_step(self) -> None:
        """Gather the root unit (and resident units) for a training, validation, test or predict step."""
        self._cursor, self.released_by_step = 0, False
        self._bw_cursor = len(self.order) - 1
        self._bw_started = False
        self.running.clear()
        for unit in self.units:
            if unit.held_for_step:
                self.gather(unit)

    def end_eval_step(self) -> None:
        for idx in list(self._gathered):
            self.release(self.units[idx], force=self.units[idx].resident)

    def is_gathered(self, unit: Unit) -> bool:
        return unit.index in self._gathered

    def watch_alias(self, unit: Unit, param: Parameter, alias: Tensor) -> None:
        """``alias = param.data`` was taken (read_watch.py): a write through it is refused at the release."""
        self._inplace.alias(unit, param, alias)

    def make_resident(self, unit: Unit) -> None:
        """A parameter of ``unit`` is read outside its forward (read_watch.py): gather it now (collective,
        at the same point of the program on every rank) and from now on for whole steps."""
        if not unit.resident:
            unit.resident = True
            self.gather(unit)

    def post_backward(self) -> None:
        super().post_backward()
        self.zpp.drop_secondaries()
        self._grads_left = {}
        if self.order and not self._order_frozen:
            self._order_frozen = True
            self._last_pos = {u: i for i, u in enumerate(self.order)}  # backward reaches a unit's last use first
        for idx in list(self._gathered):
            if not self.units[idx].held_for_step:
                self.release(self.units[idx])

    def _refresh_shards(self) -> None:
        """The 16-bit gather sources from the updated masters (offload/host_optimizer.py uploads them instead)."""
        for fg in self.groups:
            fg.refresh_shard16()

    def _write_back(self) -> None:
        self._refresh_shards()
        self.zpp.drop_secondaries()
        self.released_by_step = True
        for unit in self.units:
            if unit.held_for_step:
                self.release(unit, force=True)
            elif unit.persistent:
                self.release(unit, force=True)
                self.gather(unit)

    # ---------------------------------------------------------------- user access
    @contextmanager
    def gathered_params(self, module: Optional[nn.Module] = None, writeback: bool = False) -> Generator[None, None, None]:
        """Gather every unit holding a parameter of ``module`` (default: all) for user code (collective). With
        ``writeback=True`` in-place changes made inside (the same on every rank) are copied into the shards."""
        wanted = {id(p) for p in (module.parameters() if module is not None else [])}
        units = [u for u in self.units if u.buckets and (module is None or any(id(p) in wanted for p in u.params))]
        already = {u.index for u in units if u.index in self._gathered}
        for u in units:
            if u.index in self._inexact:  # qwZ's quantized copy: user code reads and writes back exact values
                self.release(u, force=True)
            self.gather(u, exact=True)
        after_step, self.released_by_step = self.released_by_step, False  # read_watch.py [Note: reads after a step]
        try:
            yield
        finally:
            for u in units if writeback else []:  # rebind.py [Note: replaced parameter storage]; re-pointing the
                for gi, bi in u.buckets:  # parameters is a use read_watch.py refuses after the step, hence first
                    self.all_groups[gi].rebind_bucket(bi, self.param_names)
            self.released_by_step = after_step
            for u in units:
                if writeback:
                    for gi, bi in u.buckets:
                        fg = self.all_groups[gi]
                        b = fg.layout.buckets[bi]
                        lo, hi = b.chunk_range(fg.shard)
                        fg.master_chunk(bi).copy_(fg.full[bi][lo - b.start : hi - b.start])
                        if fg.shard16 is not None:
                            fg.shard16[b.shard_offset : b.shard_offset + b.chunk].copy_(fg.master_chunk(bi))
                    self._inplace.gathered(u)
                if u.index not in already:
                    self.release(u)
            if writeback:  # the user set the weights: 16-bit states' Kahan words start again (states16.py)
                self._masters_replaced()

    def after_master_load(self) -> None:
        """Masters were overwritten (checkpoint load): refresh the 16-bit shards and persistent units."""
        self._masters_replaced()
        self._write_back()

    def sharded_params(self) -> list[Parameter]:
        """Every parameter this engine partitions (trainable and frozen)."""
        return [p for fg in self.all_groups for p in fg.params]

    def param_shards(self, trainable: bool = True, frozen: bool = True) -> list[Tensor]:
        """This rank's partition of the parameters: what each gather sends (memory reports and tests)."""
        out = []
        if trainable:
            out += [fg.shard16 if fg.shard16 is not None else fg.master for fg in self.groups]
        if frozen:
            out += [fg.master for fg in self.frozen_groups]
        return out

    def bytes_sent(self) -> dict[str, int]:
        return self.traffic.snapshot()

    def install_module_hooks(self) -> None:
        """Forward pre/post hooks on every unit (again after ``remove_hooks``, for validate/test/predict)."""
        if self._module_hooks:
            return
        for unit in self.units[1:]:
            assert unit.module is not None
            if unit.buckets:
                self._module_hooks.append(
                    unit.module.register_forward_pre_hook(self._make_pre_forward(unit), with_kwargs=True)
                )
                self._module_hooks.append(unit.module.register_forward_hook(self._make_post_forward(unit)))

    def remove_hooks(self) -> None:
        super().remove_hooks()
        for h in self._frozen_grad_hooks:
            h.remove()
        self._frozen_units = {u.index for u in self.units if any(gi >= len(self.groups) for gi, _ in u.buckets)}
        """Units holding frozen weights: released after their input gradients, not their own ([Note: frozen ...])."""
        self._frozen_grad_hooks = []
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    def unshard_to_plain(self) -> None:
        """Give every parameter its own full storage again, the masters' values in their dtype (fp32), e.g. before
        a new engine is built for a second ``fit``. Collective; costs the full model's memory in fp32."""
        from lightning_zero.zero.state_dict import gather_flat

        self.remove_hooks()
        for fg in self.all_groups:
            full = gather_flat(self, fg, fg.master)
            for slot in fg.layout.slots:
                p = local_tensor(fg.params[slot.index])
                # in the masters' dtype (fp32 for what an optimizer steps): the next engine takes its masters from
                # these values, so the compute dtype would start a second fit from rounded weights, unlike ddp's
                value = full[slot.offset : slot.offset + slot.numel].view(p.shape)
                point_local(fg.params[slot.index], value.to(fg.master.dtype).clone())
        self._gathered.clear()
        self._pending.clear()
        self._inexact.clear()
        self._inplace.clear()
        self._secondary_due.clear()
        self.zpp.drop_secondaries()
