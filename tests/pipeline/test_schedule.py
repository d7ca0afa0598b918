"""Schedules as pure data: bubble formula, dependency order, in-flight bound, matched exchanges."""

from __future__ import annotations

import itertools

import pytest

from lightning_zero.pipeline.schedule import (
    Compute, Exchange, Message, build_plan, format_plan, interleaved_forward_order, theoretical_bubble,
)

CASES = [(p, m) for p in (2, 3, 4) for m in (1, 2, 3, 4, 8)]
INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p) for v in (2, 3)]


def _all_plans():
    for kind in ("1f1b", "gpipe"):
        for p, m in CASES:
            yield build_plan(kind, p, m)
            yield build_plan(kind, p, m, forward_only=True)
    for p, m, v in INTERLEAVED:
        yield build_plan("interleaved", p, m, v)
        yield build_plan("interleaved", p, m, v, forward_only=True)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", CASES)
def test_table_bubble_is_the_formula(kind: str, p: int, m: int) -> None:
    plan = build_plan(kind, p, m)
    assert plan.makespan == 3 * (m + p - 1)  # forward 1 tick, backward 2
    assert build_plan(kind, p, m, costs=(1, 1)).makespan == 2 * (m + p - 1)
    for r in range(p):
        assert plan.table_bubble(r) == pytest.approx(theoretical_bubble(kind, p, m))
    assert theoretical_bubble(kind, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_bubble_shrinks_by_the_chunk_count(p: int, m: int, v: int) -> None:
    plan = build_plan("interleaved", p, m, v)
    for r in range(p):
        assert plan.table_bubble(r) == pytest.approx((p - 1) / (v * m + p - 1))
        assert plan.table_bubble(r) < theoretical_bubble("1f1b", p, m)


def test_every_microbatch_is_forwarded_before_its_backward_everywhere() -> None:
    for plan in _all_plans():
        ticks: dict[tuple[str, int, int], int] = {}
        for r in range(plan.stages):
            for s in plan.steps[r]:
                if isinstance(s, Compute):
                    ticks[(s.action.op, s.action.mb, plan.vstage(r, s.action.chunk))] = s.tick
        last = plan.num_virtual - 1
        ops = ("F",) if plan.forward_only else ("F", "B")
        assert len(ticks) == len(ops) * plan.microbatches * plan.num_virtual  # each exactly once
        for mb, v in itertools.product(range(plan.microbatches), range(plan.num_virtual)):
            if v > 0:
                assert ticks[("F", mb, v - 1)] < ticks[("F", mb, v)]
            if not plan.forward_only:
                assert ticks[("F", mb, v)] < ticks[("B", mb, v)]
                if v < last:
                    assert ticks[("B", mb, v + 1)] < ticks[("B", mb, v)]


@pytest.mark.parametrize("p,m", CASES)
def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight(p: int, m: int) -> None:
    one = build_plan("1f1b", p, m)
    gpipe = build_plan("gpipe", p, m)
    for s in range(p):
        assert one.max_in_flight(s) == min(p - s, m)
        assert gpipe.max_in_flight(s) == m


def test_1f1b_steady_state_alternates() -> None:
    plan = build_plan("1f1b", 4, 8)
    for s in range(4):
        ops = "".join(a.op for a in plan.actions(s))
        warm = 4 - 1 - s
        assert ops == "F" * warm + "FB" * (8 - warm) + "B" * warm


def test_exchanges_match_between_ranks() -> None:
    """Every message is sent and received in the exchange of the same tick (what makes batched p2p
    deadlock-free on NCCL), after it was produced and before it is consumed."""
    for plan in _all_plans():
        sends: dict[Message, tuple[int, int]] = {}
        recvs: dict[Message, tuple[int, int]] = {}
        for r in range(plan.stages):
            for s in plan.steps[r]:
                if isinstance(s, Exchange):
                    assert s.sends or s.recvs
                    for msg in s.sends:
                        assert plan.rank_of(msg.src) == r and msg not in sends
                        sends[msg] = (r, s.tick)
                    for msg in s.recvs:
                        assert plan.rank_of(msg.dst) == r and msg not in recvs
                        recvs[msg] = (r, s.tick)
        assert set(sends) == set(recvs)
        for msg, (_, tick) in sends.items():
            assert recvs[msg][1] == tick
        n_msgs = plan.microbatches * (plan.num_virtual - 1) * (1 if plan.forward_only else 2)
        assert len(sends) == n_msgs


def test_simulated_rendezvous_never_deadlocks() -> None:
    """Execute every plan with blocking exchanges (a rank waits until every peer of its exchange has
    reached the same exchange): all ranks must finish."""
    for plan in _all_plans():
        pos = [0] * plan.stages
        passed: list[set[int]] = [set() for _ in range(plan.stages)]

        def at_exchange(q: int, tick: int) -> bool:
            step = plan.steps[q][pos[q]] if pos[q] < len(plan.steps[q]) else None
            return (isinstance(step, Exchange) and step.tick == tick) or tick in passed[q]

        while any(pos[r] < len(plan.steps[r]) for r in range(plan.stages)):
            moved = False
            for r in range(plan.stages):
                while pos[r] < len(plan.steps[r]):
                    step = plan.steps[r][pos[r]]
                    if isinstance(step, Exchange):
                        peers = {plan.rank_of(m.dst) for m in step.sends} | {plan.rank_of(m.src) for m in step.recvs}
                        if not all(at_exchange(q, step.tick) for q in peers):
                            break
                        passed[r].add(step.tick)
                    pos[r] += 1
                    moved = True
            assert moved, f"deadlock in {plan.kind} P={plan.stages} M={plan.microbatches}\n{format_plan(plan)}"


def test_interleaved_forward_order_groups_microbatches_by_stage_count() -> None:
    assert interleaved_forward_order(2, 4, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


def test_bad_schedule_arguments() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_plan("zigzag", 2, 4)
    with pytest.raises(ValueError, match="one chunk per rank"):
        build_plan("1f1b", 2, 4, chunks=2)


def _replay_nccl(plan, tf: float, tb: float) -> float:
    """Replay a plan as the runtime executes it under NCCL's rules; returns the bubble.

    Each rank has a compute stream (actions take ``tf``/``tb``) and one communicator stream on
    which its exchanges run in order. An exchange starts when the rank posts it and its previous
    exchange is done, and completes once every peer involved has started the matching one. The
    compute stream waits for exchanges that receive something; sends complete in the background.
    """
    p = plan.stages
    now, busy, pos, comm_free = [0.0] * p, [0.0] * p, [0] * p, [0.0] * p
    started: dict[tuple[int, int], float] = {}
    while any(pos[r] < len(plan.steps[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(plan.steps[r]):
                step = plan.steps[r][pos[r]]
                if isinstance(step, Compute):
                    cost = tf if step.action.op == "F" else tb
                    now[r] += cost
                    busy[r] += cost
                else:
                    started.setdefault((r, step.tick), max(now[r], comm_free[r]))
                    peers = {plan.rank_of(m.dst) for m in step.sends} | {plan.rank_of(m.src) for m in step.recvs}
                    if not all((q, step.tick) in started for q in peers):
                        break
                    done = max(started[(q, step.tick)] for q in peers | {r})
                    comm_free[r] = done
                    if step.recvs:
                        now[r] = max(now[r], done)
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    span = max(now + comm_free)
    return 1.0 - sum(busy) / (p * span)


@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0, 3.0])
def test_replay_with_real_costs_reaches_the_formula(ratio: float) -> None:
    """With backward = ratio x forward, the executed 1F1B/GPipe plans idle exactly as the textbook
    pipeline, whatever the ratio (the table assumes 2)."""
    for kind, p, m in [("1f1b", 2, 4), ("1f1b", 2, 16), ("1f1b", 4, 8), ("gpipe", 2, 8), ("gpipe", 4, 4)]:
        assert _replay_nccl(build_plan(kind, p, m), 1.0, ratio) == pytest.approx(theoretical_bubble(kind, p, m))


def test_replay_interleaved() -> None:
    """Interleaved plans reach the formula when backward = 2 x forward, as the table assumes; with
    other ratios their exchanges couple chunks and lose a few points on 4 stages (documented)."""
    for p, m, v in [(2, 4, 2), (2, 8, 3), (4, 8, 2), (4, 16, 2)]:
        bubble = _replay_nccl(build_plan("interleaved", p, m, v), 1.0 / v, 2.0 / v)
        assert bubble == pytest.approx(theoretical_bubble("interleaved", p, m, v))
        worst = max(_replay_nccl(build_plan("interleaved", p, m, v), 1.0 / v, r / v) for r in (1.0, 3.0))
        assert worst < theoretical_bubble("interleaved", p, m, v) + 0.11


def _consumed(plan, rank: int, action) -> set[Message]:
    """Messages ``action`` on ``rank`` reads: the activation of its forward, the gradient of its backward."""
    v = plan.vstage(rank, action.chunk)
    if action.op == "F":
        return {Message("act", action.mb, v - 1, v)} if v > 0 else set()
    return {Message("grad", action.mb, v + 1, v)} if v < plan.num_virtual - 1 else set()


@pytest.mark.parametrize("p,m", CASES)
def test_1f1b_receives_just_before_need_paired_with_the_last_send(p: int, m: int) -> None:
    """[Note: paired exchanges of 1F1B]: every receive is posted right before the action that reads it (never a
    compute action between them), and an exchange that sends to a neighbour also receives what the next action
    needs from that neighbour (Megatron's send_forward_recv_backward / send_backward_recv_forward), so the
    steady state posts one batch per action; exchange names are unique per rank."""
    plan = build_plan("1f1b", p, m)
    for r in range(p):
        steps = plan.steps[r]
        ticks = [s.tick for s in steps if isinstance(s, Exchange)]
        assert len(ticks) == len(set(ticks))
        for i, s in enumerate(steps):
            if not isinstance(s, Exchange):
                continue
            nxt = next((c for c in steps[i + 1:] if isinstance(c, Compute)), None)
            needed = _consumed(plan, r, nxt.action) if nxt else set()
            assert set(s.recvs) <= needed, (r, s)  # no early receive
            if i + 1 < len(steps) and isinstance(steps[i + 1], Compute):  # what the next action reads from a peer of this exchange is here
                peers = {plan.rank_of(x.dst) for x in s.sends} | {plan.rank_of(x.src) for x in s.recvs}
                assert {x for x in needed if plan.rank_of(x.src) in peers} <= set(s.recvs), (r, s)
        paired = [s for s in steps if isinstance(s, Exchange) and s.sends and s.recvs]
        if r == 0:  # after each steady-state forward: send its activation, receive the gradient the backward reads
            assert len(paired) == m - min(p - 1, m)
        if r == p - 1:  # after each backward but the last: send its gradient, receive the next activation
            assert len(paired) == m - 1


def test_1f1b_last_stage_runs_its_first_backward_without_waiting_for_the_next_activation() -> None:
    """The rendezvous the trace showed (benchmarks/RESULTS.md, pp 2): the last stage used to receive micro-batch 1's
    activation before its first backward. Now its steps are receive, F0, B0, then one batch sending the gradient
    of 0 and receiving the activation of 1, and the first stage sends activation 1 in the batch receiving gradient 0."""
    plan = build_plan("1f1b", 2, 8)
    last = [str(s.action) if isinstance(s, Compute) else (s.sends, s.recvs) for s in plan.steps[1][:5]]
    assert last == [
        ((), (Message("act", 0, 0, 1),)), "F0", "B0", ((Message("grad", 0, 1, 0),), (Message("act", 1, 0, 1),)), "F1",
    ]
    first = [str(s.action) if isinstance(s, Compute) else (s.sends, s.recvs) for s in plan.steps[0][:5]]
    assert first == [
        "F0", ((Message("act", 0, 0, 1),), ()), "F1", ((Message("act", 1, 0, 1),), (Message("grad", 0, 1, 0),)), "B0",
    ]
