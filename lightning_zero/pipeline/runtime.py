"""PipelineRuntime: executes a schedule (pipeline/schedule.py) on one rank of a pipeline.

What one training call does, in order: cut the batch into micro-batches; tell the ZeRO engines to
accumulate gradients locally; walk this rank's steps of the plan (forward or backward a micro-batch
chunk, or exchange activations/gradients with the neighbouring stages); hand the gradients over to
the strategy's normal reduction (tied-weight gradients summed first); all-reduce the loss from the
last stage so every rank returns the same mean loss. Evaluation walks a forward-only plan.

[Note: why not torch.distributed.pipelining]
Its schedules (``Schedule1F1B`` etc.) were the first choice, and they do not fit Lightning's loop
with ZeRO engines underneath: (1) a ``PipelineStage`` infers the activation shapes once, at its
first step, and keeps the receive buffers; Lightning's loop changes shapes between training and
validation batches and on a last partial batch. (2) Gradient sync across micro-batches is handled
for DDP/FSDP modules only (``backward_maybe_with_nosync``); our engines need ``require_sync`` off
for every micro-batch and a reduction after the tied-weight all-reduce, and the schedule offers no
per-micro-batch hook. (3) Its ``scale_grads`` divides ``.grad`` after the last backward, which is
after a ZeRO-1 engine has reduce-scattered and zeroed those gradients. (4) It has no tied layers
and no way to time idle periods for the bubble metric. (5) Its p2p bypasses comm/collectives.py.
So the schedule is ours (pure data, tested on CPU) and this file executes it; the actions and their
order are the same as Megatron's and torch's 1F1B.

[Note: Lightning's backward]
Under automatic optimisation Lightning calls ``backward`` on what ``training_step`` returns. The
backward of every micro-batch has already run here, so the returned loss is the mean loss plus a
zero-valued leaf: its backward touches no parameter (a no-op), while Lightning's ``post_backward``
still runs and the strategy's engines reduce the accumulated gradients there, exactly once. The
micro-batch losses are scaled by ``grad_scale()`` (fp16 loss scale / accumulate_grad_batches, what
Lightning and the precision plugin would apply) divided by the number of micro-batches: each
micro-batch's backward starts from that value as its loss gradient (one cached 0-d tensor).

[Note: activation metadata]
A receiver must allocate a buffer before an activation arrives. The first time a message is sent
for a given batch signature (shapes and dtypes of the batch, which every stage of the pipeline
loads identically), its shapes travel first as a small int64 tensor; afterwards both sides use the
cached shapes, and a sender whose activation no longer matches fails loudly instead of corrupting
the receiver. Gradients need no metadata: their receiver produced the activation they belong to.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from lightning_zero.comm import collectives as C
from lightning_zero.pipeline import microbatch as mbu
from lightning_zero.pipeline.buffers import ReceiveBuffers
from lightning_zero.pipeline.module import PipelineModule
from lightning_zero.pipeline.schedule import Action, Compute, Exchange, Message, Plan, build_plan
from lightning_zero.pipeline.timing import LABELS, BubbleStats, DeviceReadback, StageTimer, label


class GradSync(Protocol):
    """How the runtime hands gradients to the data-parallel engines (see integration.py)."""

    def begin(self) -> None:
        """Before the first backward of a step: accumulate locally."""

    def finish(self) -> None:
        """After the last backward: sum tied gradients; restore the engines' sync mode."""

    def abort(self) -> None:
        """The step failed: restore the engines' sync mode without any collective."""


@dataclass
class _StepState:
    inputs: list[Any]
    labels: list[Any]
    train: bool
    want_outputs: bool = False
    loss_scale: float = 1.0
    """Gradient of each micro-batch loss: ``grad_scale()`` / micro-batches, read once per step."""
    received: dict[Message, tuple[bool, list[Tensor]]] = field(default_factory=dict)
    to_send: dict[Message, tuple[bool, list[Tensor]]] = field(default_factory=dict)
    saved: dict[tuple[int, int], tuple[list[Tensor], Any]] = field(default_factory=dict)
    """(mb, chunk) -> (input tensors, output tensors or the loss), kept for backward."""
    losses: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    sending: list[Any] = field(default_factory=list)
    """Work handles of sends not waited for yet (their tensors stay alive through them)."""


class PipelineRuntime:
    """One rank's executor. ``group`` is the pipeline group (group rank = stage)."""

    def __init__(
        self,
        module: PipelineModule,
        *,
        group: Optional[C.ProcessGroup],
        rank: int,
        stages: int,
        chunks: int,
        schedule: str,
        microbatches: int,
        device: torch.device,
        grad_scale: Callable[[], float],
        grad_sync: Optional[GradSync] = None,
        meta_cache_size: int = 16,
    ) -> None:
        self.module = module
        self.group = group
        self.rank = rank
        self.stages = stages
        self.chunks = chunks
        self.schedule = schedule
        self.microbatches = microbatches
        self.device = device
        self.grad_scale = grad_scale
        self.grad_sync = grad_sync
        self.timer = StageTimer(device)
        self.bubble = BubbleStats(stages)
        self._timing: Optional[float] = None
        """This rank's busy seconds of the step whose reduced timings ``_readback`` holds."""
        self._readback = DeviceReadback(device)
        self._meta: OrderedDict[tuple, dict[Message, mbu.ActivationMeta]] = OrderedDict()
        self._meta_cache_size = meta_cache_size
        self.buffers = ReceiveBuffers(device)
        self._loss_grad: Optional[tuple[float, Tensor, int]] = None
        """(scale, the loss gradient, its version when made): :meth:`_loss_gradient`."""
        self._last_v = stages * chunks - 1
        placement = module.placement
        assert placement is not None, "the module must be placed (materialize) before a runtime runs it"
        self._where = {v: f"the part holding layers {list(placement.layers_of(v))}" for v in placement.local_parts}

    # ------------------------------------------------------------------------------- entry points
    def run(self, inputs: Any, labels: Any) -> Tensor:
        """Training (module in train mode with grad enabled): forward + backward of every micro-batch,
        returns the mean loss for Lightning (see [Note: Lightning's backward]). Otherwise: the loss only."""
        if self.module.training and torch.is_grad_enabled():
            return self._train(inputs, labels)
        return self._evaluate(inputs, labels)

    def predict(self, inputs: Any) -> Any:
        """Outputs of the last layer for ``inputs``, on every rank of the pipeline. Called by users outside
        the Trainer's loop (which moves batches itself), so the inputs are moved to this stage's device first."""
        inputs = move_data_to_device(inputs, self.device)
        mbs, _, _ = mbu.split_batch(inputs, None, self.microbatches, strict=False)
        plan = build_plan(self.schedule, self.stages, len(mbs), self.chunks, forward_only=True)
        st = _StepState(mbs, [None] * len(mbs), train=False, want_outputs=True)
        self._execute(plan, st, ("predict", mbu.signature(inputs, None), len(mbs)))
        out = None
        if self.rank == self.stages - 1:
            parts = [mbu.flatten(st.outputs[i], "the last layer") for i in range(len(mbs))]
            is_tuple = parts[0][0]
            out = (is_tuple, [torch.cat([p[1][j] for p in parts]) for j in range(len(parts[0][1]))])
        return self._broadcast_activation(out)

    # ------------------------------------------------------------------------------- training / eval
    def _train(self, inputs: Any, labels: Any) -> Tensor:
        mbs_in, mbs_lb, _ = mbu.split_batch(inputs, labels, self.microbatches, strict=True)
        m = len(mbs_in)
        plan = build_plan(self.schedule, self.stages, m, self.chunks)
        st = _StepState(mbs_in, mbs_lb, train=True, loss_scale=self.grad_scale() / m)
        if self.grad_sync is not None:
            self.grad_sync.begin()
        try:
            self.timer.begin_step()
            self._execute(plan, st, ("train", mbu.signature(inputs, labels), m))
            self.timer.end_step()
        except BaseException:
            if self.grad_sync is not None:
                self.grad_sync.abort()
            raise
        if self.grad_sync is not None:
            self.grad_sync.finish()
        local = torch.stack([st.losses[i] for i in range(m)]).float().mean() if st.losses else None
        loss = self._reduce_loss_and_timing(local)
        dummy = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        return loss + dummy

    def _evaluate(self, inputs: Any, labels: Any) -> Tensor:
        mbs_in, mbs_lb, sizes = mbu.split_batch(inputs, labels, self.microbatches, strict=False)
        plan = build_plan(self.schedule, self.stages, len(mbs_in), self.chunks, forward_only=True)
        st = _StepState(mbs_in, mbs_lb, train=False)
        self._execute(plan, st, ("eval", mbu.signature(inputs, labels), len(mbs_in)))
        buf = torch.zeros(1, dtype=torch.float64, device=self.device)
        if st.losses:
            buf[0] = sum(st.losses[i].double() * sizes[i] for i in range(len(sizes))) / sum(sizes)
        C.all_reduce(buf, self.group, "sum")
        return buf[0].float()

    def _reduce_loss_and_timing(self, local_loss: Any) -> Tensor:
        """One all-reduce for the loss (from the last stage) and an earlier step's timings.

        The reduced timings are read at the next step (see [Note: measuring the bubble] in timing.py),
        so reading them never waits for the device.
        """
        self.collect_timing()
        prev = self.timer.take()
        buf = torch.zeros(4, dtype=torch.float64, device=self.device)
        if isinstance(local_loss, Tensor):
            buf[0] = local_loss.detach().double()
        if prev is not None:
            busy, span = prev
            buf[1] = busy
            buf[2] = span if self.rank == 0 else 0.0
            buf[3] = 1.0
        C.all_reduce(buf, self.group, "sum")
        if prev is not None:
            self._readback.put(buf)
            self._timing = prev[0]
        return buf[0].float()

    def collect_timing(self) -> None:
        """Fold the last reduced timings into the bubble statistics."""
        if self._timing is None:
            return
        local_busy, self._timing = self._timing, None
        _, busy_all, span, count = self._readback.get()
        if int(round(count)) == self.stages:
            self.bubble.add(busy_all, local_busy, span)

    # ------------------------------------------------------------------------------- plan execution
    def _execute(self, plan: Plan, st: _StepState, signature: tuple) -> None:
        cache = self._meta.get(signature)
        if cache is None:
            cache = self._meta[signature] = {}
            while len(self._meta) > self._meta_cache_size:
                self._meta.popitem(last=False)
        else:
            self._meta.move_to_end(signature)
        for step in plan.steps[self.rank]:
            if isinstance(step, Compute):
                forward = step.action.op == "F"
                with self.timer.compute(), label(LABELS[0] if forward else LABELS[1]):
                    if forward:
                        self._forward(plan, step.action, st)
                    else:
                        self._backward(plan, step.action, st)
            else:
                with label(LABELS[2]):
                    self._exchange(plan, step, st, cache)
        for work in st.sending:
            work.wait()
        st.sending.clear()
        self.buffers.end_step(st.train)

    def _forward(self, plan: Plan, a: Action, st: _StepState) -> None:
        v = plan.vstage(self.rank, a.chunk)
        if v == 0:
            x = st.inputs[a.mb]
            x_tensors: list[Tensor] = []
        else:
            is_tuple, x_tensors = st.received.pop(Message("act", a.mb, v - 1, v))
            if st.train:
                for t in x_tensors:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            x = mbu.unflatten(is_tuple, x_tensors)
        y = self.module.run_part(v, x)
        if v == self._last_v:
            if st.want_outputs:
                st.outputs[a.mb] = y
                return
            loss = self.module.compute_loss(y, st.labels[a.mb])
            st.losses[a.mb] = loss.detach()
            out: Any = loss
            sent = [loss]
        else:
            is_tuple, ys = mbu.flatten(y, self._where[v])
            st.to_send[Message("act", a.mb, v, v + 1)] = (is_tuple, ys)
            out = sent = ys
        if st.train:
            st.saved[(a.mb, a.chunk)] = (x_tensors, out)
        elif x_tensors:  # [Note: reused receive buffers] (buffers.py): read by nothing but what is sent on
            self.buffers.give("act", x_tensors, in_use=sent)

    def _backward(self, plan: Plan, a: Action, st: _StepState) -> None:
        v = plan.vstage(self.rank, a.chunk)
        x_tensors, out = st.saved.pop((a.mb, a.chunk))
        grads: list[Tensor] = []
        if v == self._last_v:
            torch.autograd.backward(out, self._loss_gradient(out, st.loss_scale))
        else:
            _, grads = st.received.pop(Message("grad", a.mb, v + 1, v))
            floats = [t for t in out if t.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads_in: list[Tensor] = []
        if v > 0:  # an input the loss did not reach gets zeros (shared, read-only: buffers.py)
            grads_in = [t.grad if t.grad is not None else self.buffers.zeros(t) for t in x_tensors if t.is_floating_point()]
            st.to_send[Message("grad", a.mb, v, v - 1)] = (True, grads_in)
        # [Note: reused receive buffers] (buffers.py): free unless what is sent on shares their storage
        self.buffers.give("grad", grads, in_use=grads_in)
        self.buffers.give("act", x_tensors, in_use=[*grads_in, *(out if isinstance(out, list) else [out])])

    def _loss_gradient(self, loss: Tensor, scale: float) -> Tensor:
        """The gradient a micro-batch loss starts its backward with: ``scale`` as a 0-d tensor, made once and
        reused while the scale stays (``(loss * scale).backward()`` launched a multiply, a fill of ones and the
        multiply's backward per micro-batch for the same value). Made again if anything wrote into it (its
        version counter moved: a loss whose custom backward scales ``grad_output`` in place)."""
        cached = self._loss_grad
        if (cached is None or cached[0] != scale or cached[1].dtype != loss.dtype or cached[1].device != loss.device
                or cached[1]._version != cached[2]):
            g = torch.full((), scale, dtype=loss.dtype, device=loss.device)
            cached = self._loss_grad = (scale, g, g._version)
        return cached[1]

    def _exchange(self, plan: Plan, ex: Exchange, st: _StepState, cache: dict[Message, mbu.ActivationMeta]) -> None:
        # phase 1: shapes of activations not seen before for this batch signature
        meta_sends: list[tuple[Tensor, int]] = []
        meta_recvs: list[tuple[Tensor, int]] = []
        pending: list[tuple[Message, Tensor]] = []
        for m in ex.sends:
            if m.kind != "act":
                continue
            meta = mbu.describe(*st.to_send[m])
            known = cache.get(m)
            if known is None:
                cache[m] = meta
                meta_sends.append((mbu.encode(meta, self.device), plan.rank_of(m.dst)))
            elif known != meta:
                raise RuntimeError(
                    f"the activation of micro-batch {m.mb} leaving pipeline part {m.src} changed from {known} to "
                    f"{meta} between steps with the same batch shapes; pipelined layers must produce shapes that "
                    "depend only on the input shapes."
                )
        for m in ex.recvs:
            if m.kind == "act" and m not in cache:
                buf = torch.empty(mbu.META_NUMEL, dtype=torch.int64, device=self.device)
                meta_recvs.append((buf, plan.rank_of(m.src)))
                pending.append((m, buf))
        if meta_sends or meta_recvs:
            C.send_recv(meta_sends, meta_recvs, self.group)
        for m, buf in pending:
            cache[m] = mbu.decode(buf)
        # phase 2: the tensors themselves
        sends: list[tuple[Tensor, int]] = []
        for m in ex.sends:
            _, tensors = st.to_send.pop(m)
            sends += [(t.detach().contiguous(), plan.rank_of(m.dst)) for t in tensors]
        recvs: list[tuple[Tensor, int]] = []
        arrived: list[tuple[Message, bool, list[Tensor]]] = []
        for m in ex.recvs:
            if m.kind == "act":
                meta = cache[m]
                bufs, is_tuple = [self.buffers.take("act", t.shape, t.dtype) for t in meta.tensors], meta.is_tuple
            else:
                _, out = st.saved[(m.mb, m.dst // self.stages)]
                bufs, is_tuple = [self.buffers.take("grad", o.shape, o.dtype) for o in out if o.is_floating_point()], True
            recvs += [(b, plan.rank_of(m.src)) for b in bufs]
            arrived.append((m, is_tuple, bufs))
        works = C.send_recv(sends, recvs, self.group, wait=False)
        if len(works) == len(sends) + len(recvs):  # one handle per operation: wait for the receives only
            for work in works[len(sends):]:
                work.wait()
            st.sending += works[: len(sends)]
        elif recvs:  # one handle for the batch (NCCL): the compute stream waits for all of it
            for work in works:
                work.wait()
        else:  # only sends: they complete in the background (see [Note: schedules as a tick table])
            st.sending += works
        for m, is_tuple, bufs in arrived:
            st.received[m] = (is_tuple, bufs)

    # ------------------------------------------------------------------------------- helpers
    def _broadcast_activation(self, value: Optional[tuple[bool, list[Tensor]]]) -> Any:
        """Broadcast a (tuple of) tensor(s) from the last stage to every rank of the pipeline."""
        src = self.stages - 1
        header = mbu.encode(mbu.describe(*value), self.device) if value is not None else torch.empty(
            mbu.META_NUMEL, dtype=torch.int64, device=self.device
        )
        C.broadcast(header, src, self.group)
        meta = mbu.decode(header)
        tensors = value[1] if value is not None else meta.empty(self.device)
        for t in tensors:
            C.broadcast(t, src, self.group)
        return mbu.unflatten(meta.is_tuple, tensors)


__all__ = ["PipelineRuntime", "GradSync"]
