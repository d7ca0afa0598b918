"""Pipeline schedules as pure data: which micro-batch each rank runs forward or backward, in what order,
and in which exchange every activation and gradient crosses between ranks. No tensors, no process
groups: everything here is unit-tested on CPU, and the runtime only executes what it is given.

[Note: schedules as a tick table]
A schedule (a :class:`Plan`) is derived in three steps:

1. *Program order*: each rank's list of compute actions ``F(mb, chunk)`` / ``B(mb, chunk)``, as in
   GPipe (all forwards, then all backwards), 1F1B (PipeDream-flush / Megatron: stage ``s`` runs
   ``P - 1 - s`` warm-up forwards, then alternates one forward and one backward, then drains) or
   Megatron's interleaved 1F1B (``V`` model chunks per rank, micro-batches in groups of ``P``).
2. *Tick table*: every action gets the earliest tick at which it can run given its rank's order and
   its data dependencies, a forward taking 1 tick and a backward 2 (as-soon-as-possible list
   scheduling). A program order that cannot complete is rejected here, before any process waits.
3. *Exchanges*: each message (an activation going down, a gradient going up) crosses ranks in the
   exchange at the tick that produced it, and both its sender and its receiver place it there.

Because both sides of every message derive the same exchange from the same table, every pair of
ranks posts matching batches of sends and receives in the same order. That is what makes batched
point-to-point deadlock-free on NCCL, which runs the p2p operations of one communicator in order on
one stream (a send posted alone before the peer's matching receive can block every later operation
of that pair), and on gloo. The runtime waits for an exchange only when it receives something;
sends complete in the background (runtime.py). A rank therefore waits only for data it needs,
never for the whole pipeline, and idle ticks cost nothing. 1F1B training places its exchanges as
Megatron does instead (next note). ``tests/pipeline`` replays
every plan under NCCL's rules with backward = 2 x forward and finds the textbook bubble.

[Note: paired exchanges of 1F1B]
1F1B training does not use step 3's placement: a receive placed at the tick its message is produced
made a rank wait for data it needed only after its next action (the last stage of two waited for
the second activation before running its first backward, a rendezvous with the first stage's second
forward), and a send and the next receive from the same neighbour crossed in two batches. Its
exchanges are Megatron's instead (``send_forward_recv_backward`` after a forward,
``send_backward_recv_forward`` after a backward): each rank receives just before the action that
consumes the message, in one ``batch_isend_irecv`` together with the send its previous action made to
the same neighbour. Both sides of each pair derive the same sequence (rank ``s``: ``W`` lone sends
of activations, ``M - W`` send+receive pairs, ``W`` lone gradient receives; rank ``s + 1`` the
mirror), so the batches still match one to one; an exchange is named by the tick of its latest
message, and a middle stage's warm-up send and receive of the same tick share one batch.
Receives are posted as late as possible rather than early: on NCCL a receive posted ahead of need
is a kernel spinning on SMs beside the compute (the trace in benchmarks/RESULTS.md: the same GEMM
130 us on the stage without one, 145-160 us on the stage with one) and, the communicator's
operations running in order on one stream, it also holds back every later send of the pair. Posted
just before need, the compute stream waits for it at once, so nothing spins beside compute but a
warm-up or drain send, which its peer is already waiting to receive.

GPipe and 1F1B finish in ``3 (M + P - 1)`` ticks, so each rank idles ``(P - 1) / (M + P - 1)`` of
the time, the formula ``theoretical_bubble`` returns; interleaving ``V`` chunks gives
``(P - 1) / (V M + P - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from lightning_zero.config.strategy import VALID_SCHEDULES as SCHEDULES

COSTS = (1, 2)
"""Ticks of a forward and of a backward in the table (a backward does about twice the matmuls)."""


@dataclass(frozen=True, order=True)
class Action:
    """One compute action of a rank: forward or backward of micro-batch ``mb`` through its ``chunk``."""

    op: str
    """'F' (forward) or 'B' (backward)."""
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, order=True)
class Message:
    """A tensor (or tuple of tensors) crossing from virtual stage ``src`` to ``dst``."""

    kind: str
    """'act' (forward activation, src + 1 == dst) or 'grad' (its gradient, src - 1 == dst)."""
    mb: int
    src: int
    dst: int


@dataclass(frozen=True)
class Compute:
    """Run ``action`` (at ``tick`` of the unit-cost table)."""

    tick: int
    action: Action


@dataclass(frozen=True)
class Exchange:
    """Post these sends and receives together, then wait for all of them."""

    tick: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


Step = Union[Compute, Exchange]


@dataclass(frozen=True)
class Plan:
    """A schedule for ``stages`` ranks, ``chunks`` model chunks per rank and ``microbatches`` micro-batches.

    Virtual stage ``v`` (the ``v``-th slice of the layer list) lives on rank ``v % stages`` as its
    chunk ``v // stages``; activations flow from ``v`` to ``v + 1``.
    """

    kind: str
    stages: int
    chunks: int
    microbatches: int
    forward_only: bool
    steps: tuple[tuple[Step, ...], ...]
    """Per rank, what to execute, in order."""
    makespan: int
    """Length of the tick table."""
    costs: tuple[int, int] = COSTS
    """Ticks of a forward and of a backward in the table."""

    @property
    def num_virtual(self) -> int:
        return self.stages * self.chunks

    def vstage(self, rank: int, chunk: int) -> int:
        return chunk * self.stages + rank

    def rank_of(self, vstage: int) -> int:
        return vstage % self.stages

    def actions(self, rank: int) -> list[Action]:
        return [s.action for s in self.steps[rank] if isinstance(s, Compute)]

    def table_bubble(self, rank: int) -> float:
        """Idle fraction of ``rank`` in the tick table (actions costing ``costs``)."""
        busy = sum(self.costs[0] if a.op == "F" else self.costs[1] for a in self.actions(rank))
        return 1.0 - busy / self.makespan

    def max_in_flight(self, rank: int) -> int:
        """Most micro-batch chunks forwarded but not yet backwarded at once (activation memory)."""
        live = peak = 0
        for a in self.actions(rank):
            live += 1 if a.op == "F" else -1
            peak = max(peak, live)
        return peak


def theoretical_bubble(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle fraction of each stage for equal-cost stages: ``(P - 1) / (M + P - 1)``; interleaving ``V``
    chunks per rank divides the warm-up and drain by ``V``: ``(P - 1) / (V M + P - 1)``."""
    v = chunks if kind == "interleaved" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


# ---------------------------------------------------------------------------------------- program orders
def _program_gpipe(stages: int, microbatches: int, rank: int) -> list[Action]:
    return [Action("F", m) for m in range(microbatches)] + [Action("B", m) for m in range(microbatches)]


def _program_1f1b(stages: int, microbatches: int, rank: int) -> list[Action]:
    warmup = min(stages - 1 - rank, microbatches)
    prog = [Action("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        prog += [Action("F", warmup + i), Action("B", i)]
    prog += [Action("B", m) for m in range(microbatches - warmup, microbatches)]
    return prog


def interleaved_forward_order(stages: int, microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward of a rank: groups of ``stages`` micro-batches go through
    chunk 0, then chunk 1, ... (Megatron's order; a last, smaller group when M % P != 0)."""
    order = []
    for start in range(0, microbatches, stages):
        group = range(start, min(start + stages, microbatches))
        for c in range(chunks):
            order += [(m, c) for m in group]
    return order


def _program_interleaved(stages: int, microbatches: int, rank: int, chunks: int) -> list[Action]:
    fwd = interleaved_forward_order(stages, microbatches, chunks)
    bwd = [(m, chunks - 1 - c) for m, c in fwd]
    total = len(fwd)
    warmup = min(total, (stages - rank - 1) * 2 + (chunks - 1) * stages)
    prog = [Action("F", *fwd[k]) for k in range(warmup)]
    for i in range(total - warmup):
        prog += [Action("F", *fwd[warmup + i]), Action("B", *bwd[i])]
    prog += [Action("B", *bwd[k]) for k in range(total - warmup, total)]
    return prog


def _programs(kind: str, stages: int, microbatches: int, chunks: int, forward_only: bool) -> list[list[Action]]:
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {kind!r}.")
    if kind != "interleaved" and chunks != 1:
        raise ValueError(f"schedule {kind!r} runs one chunk per rank; got chunks={chunks}.")
    if kind == "interleaved":
        progs = [_program_interleaved(stages, microbatches, r, chunks) for r in range(stages)]
    elif kind == "gpipe":
        progs = [_program_gpipe(stages, microbatches, r) for r in range(stages)]
    else:
        progs = [_program_1f1b(stages, microbatches, r) for r in range(stages)]
    if forward_only:
        progs = [[a for a in p if a.op == "F"] for p in progs]
    return progs


# ---------------------------------------------------------------------------------------- tick table
def _timetable(stages: int, chunks: int, programs: list[list[Action]], costs: tuple[int, int]) -> list[list[int]]:
    """Start tick of every action (same shape as ``programs``), as soon as possible, a forward taking
    ``costs[0]`` ticks and a backward ``costs[1]``."""
    last = stages * chunks - 1
    done: dict[tuple[str, int, int], int] = {}
    ticks: list[list[int]] = [[] for _ in programs]
    free = [0] * stages
    pos = [0] * stages
    while any(pos[r] < len(programs[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            while pos[r] < len(programs[r]):
                a = programs[r][pos[r]]
                v = a.chunk * stages + r
                if a.op == "F":
                    deps = [("F", a.mb, v - 1)] if v > 0 else []
                else:
                    deps = [("F", a.mb, v)] + ([("B", a.mb, v + 1)] if v < last else [])
                if any(d not in done for d in deps):
                    break
                t = max([free[r]] + [done[d] for d in deps])
                end = t + (costs[0] if a.op == "F" else costs[1])
                done[(a.op, a.mb, v)] = end
                ticks[r].append(t)
                free[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(programs[r][pos[r]]) for r in range(stages) if pos[r] < len(programs[r])}
            raise RuntimeError(f"pipeline program order cannot complete; ranks wait at {stuck}")
    return ticks


def _messages_of(action: Action, rank: int, stages: int, chunks: int) -> list[Message]:
    """What ``action`` on ``rank`` sends when it finishes."""
    v = action.chunk * stages + rank
    if action.op == "F" and v < stages * chunks - 1:
        return [Message("act", action.mb, v, v + 1)]
    if action.op == "B" and v > 0:
        return [Message("grad", action.mb, v, v - 1)]
    return []


@lru_cache(maxsize=64)
def build_plan(
    kind: str, stages: int, microbatches: int, chunks: int = 1, forward_only: bool = False,
    costs: tuple[int, int] = COSTS,
) -> Plan:
    """The :class:`Plan` of a schedule (pure and cached: every rank computes the same one).

    A message crosses in the exchange at the tick where it is produced (1F1B training: [Note: paired
    exchanges of 1F1B]); the exchange sits at that
    tick on the sender's and the receivers' timelines alike: after every action that starts earlier,
    before every action that starts then or later.
    """
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(f"need stages, microbatches, chunks >= 1; got {stages}, {microbatches}, {chunks}.")
    programs = _programs(kind, stages, microbatches, chunks, forward_only)
    ticks = _timetable(stages, chunks, programs, costs)
    cost = {"F": costs[0], "B": costs[1]}
    makespan = max((t + cost[a.op] for p, ts in zip(programs, ticks) for a, t in zip(p, ts)), default=0)
    produced: dict[int, list[Message]] = {}
    for r in range(stages):
        for a, t in zip(programs[r], ticks[r]):
            for m in _messages_of(a, r, stages, chunks):
                if not (forward_only and m.kind == "grad"):
                    produced.setdefault(t + cost[a.op], []).append(m)
    steps: list[tuple[Step, ...]] = []
    if kind == "1f1b" and not forward_only and stages > 1:
        done = {m: t for t, msgs in produced.items() for m in msgs}
        steps = [_paired_1f1b(r, stages, microbatches, ticks[r], done) for r in range(stages)]
        return Plan(kind, stages, chunks, microbatches, forward_only, tuple(steps), makespan, costs)
    for r in range(stages):
        events: list[tuple[int, int, Step]] = [(t, 1, Compute(t, a)) for a, t in zip(programs[r], ticks[r])]
        for t, msgs in produced.items():
            sends = tuple(sorted(m for m in msgs if m.src % stages == r))
            recvs = tuple(sorted(m for m in msgs if m.dst % stages == r))
            if sends or recvs:
                events.append((t, 0, Exchange(t, sends, recvs)))
        steps.append(tuple(step for _, _, step in sorted(events, key=lambda e: (e[0], e[1]))))
    return Plan(kind, stages, chunks, microbatches, forward_only, tuple(steps), makespan, costs)


def _paired_1f1b(
    rank: int, stages: int, microbatches: int, ticks: list[int], done: dict[Message, int],
) -> tuple[Step, ...]:
    """One rank's steps of 1F1B training with Megatron's exchanges (see [Note: paired exchanges of 1F1B]).

    ``ticks``: start tick of each action in the program order; ``done``: the tick each message is produced
    at, which names the exchange it crosses in (the tick of an exchange is that of its latest message).
    """
    first, last = rank == 0, rank == stages - 1
    warm = min(stages - 1 - rank, microbatches)
    act_in = lambda m: Message("act", m, rank - 1, rank)  # noqa: E731
    act_out = lambda m: Message("act", m, rank, rank + 1)  # noqa: E731
    grad_in = lambda m: Message("grad", m, rank + 1, rank)  # noqa: E731
    grad_out = lambda m: Message("grad", m, rank, rank - 1)  # noqa: E731
    at = iter(ticks)
    out: list[Step] = []

    def exchange(sends: list[Message], recvs: list[Message]) -> None:
        if not (sends or recvs):
            return
        tick = max(done[m] for m in (*sends, *recvs))
        prev = out[-1] if out else None
        if isinstance(prev, Exchange) and prev.tick == tick:  # a middle stage's warm-up: both neighbours at once
            sends, recvs = [*prev.sends, *sends], [*prev.recvs, *recvs]
            out.pop()
        out.append(Exchange(tick, tuple(sorted(sends)), tuple(sorted(recvs))))

    def compute(op: str, mb: int) -> None:
        out.append(Compute(next(at), Action(op, mb)))

    for m in range(warm):  # warm-up: receive, forward, send (the last stage has none)
        exchange([], [] if first else [act_in(m)])
        compute("F", m)
        exchange([act_out(m)], [])
    steady = microbatches - warm
    if steady and not first:
        exchange([], [act_in(warm)])
    for i in range(steady):  # send_forward_recv_backward, send_backward_recv_forward
        compute("F", warm + i)
        exchange([] if last else [act_out(warm + i)], [] if last else [grad_in(i)])
        compute("B", i)
        nxt = [act_in(warm + i + 1)] if i + 1 < steady else []
        exchange([] if first else [grad_out(i)], [] if first else nxt)
    for m in range(steady, microbatches):  # drain: receive, backward, send
        exchange([], [grad_in(m)])
        compute("B", m)
        exchange([] if first else [grad_out(m)], [])
    return tuple(out)


def format_plan(plan: Plan) -> str:
    """One line per rank, one column per tick (for debugging and docs)."""
    lines = []
    for r in range(plan.stages):
        cells = ["."] * plan.makespan
        for s in plan.steps[r]:
            if isinstance(s, Compute):
                span = plan.costs[0] if s.action.op == "F" else plan.costs[1]
                cells[s.tick : s.tick + span] = [str(s.action)] + ["~"] * (span - 1)
        lines.append(f"rank {r}: " + " ".join(f"{c:>5}" for c in cells))
    return "\n".join(lines)


__all__ = [
    "SCHEDULES", "Action", "Message", "Compute", "Exchange", "Step", "Plan", "build_plan",
    "theoretical_bubble", "interleaved_forward_order", "format_plan",
]
