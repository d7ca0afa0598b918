"""Scenarios of the quantized-collective tests (tests/helpers/harness.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_zero.comm import quantized
from tests.helpers.harness import ScenarioContext, scenario


@scenario("quant.collectives")
def collectives(ctx: ScenarioContext) -> dict:
    """Every rank's quantized all-gather and reduce-scatter against the exact ones, per bit width."""
    dist.init_process_group("gloo")
    try:
        n, r = dist.get_world_size(), dist.get_rank()
        out = {}
        for bits in (8, 4):
            g = torch.Generator().manual_seed(100 + r)
            shard = torch.randn(96, generator=g) * (r + 1)
            exact = [torch.empty_like(shard) for _ in range(n)]
            dist.all_gather(exact, shard)
            got, sent = quantized.all_gather(shard, None, bits=bits, block=32)
            full = torch.randn(96 * n, generator=g)
            exact_sum = full.clone()
            dist.all_reduce(exact_sum)
            mine, rs_sent = quantized.reduce_scatter(full, None, bits=bits, block=32)
            # each contribution's scale bound: max |chunk| / q_max per block, gathered for the check
            q_max = {8: 127, 4: 7}[bits]
            steps = full.view(n, -1, 32).abs().amax(-1) / q_max  # [chunk, block] of this rank
            all_steps = torch.zeros(n * steps.numel())
            dist.all_gather_into_tensor(all_steps, steps.reshape(-1).contiguous())
            all_steps = all_steps.view(n, *steps.shape)
            bound = all_steps[:, r].sum(0).repeat_interleave(32) / 2  # half-steps of the N contributions
            out[bits] = {
                "ag_err": float((got - torch.cat(exact)).abs().max()),
                "ag_bound": float(torch.cat(exact).view(-1, 32).abs().amax(-1).max() / q_max / 2),
                "rs_ok": bool(((mine - exact_sum.chunk(n)[r]).abs() <= bound + 1e-6).all()),
                "rs_err": float((mine - exact_sum.chunk(n)[r]).abs().max()),
                "ag_sent": sent, "rs_sent": rs_sent,
                "exact_ag_bytes": shard.numel() * 2 * (n - 1), "exact_rs_bytes": full.numel() // n * 2 * (n - 1),
            }
        if n == 4:
            out["hier"] = _hierarchical(r, n)
        return out
    finally:
        dist.destroy_process_group()


def _hierarchical(r: int, n: int, h: int = 2, bits: int = 4, block: int = 32) -> dict:
    """The two-level reduce-scatter (nodes of ``h`` ranks) against the exact sum: within the level-1 half-steps
    of the ``n`` contributions plus the level-2 half-steps of the ``n / h`` re-quantized node sums (computed
    here from every rank's input, gathered, with the level-1 bound added to each block's maximum)."""
    k = n // h
    inner = [dist.new_group(list(range(q * h, (q + 1) * h))) for q in range(k)][r // h]
    outer = [dist.new_group(list(range(l, n, h))) for l in range(h)][r % h]
    m = 96  # a multiple of the block: level 1's blocks then cover one chunk each, as the flat bound assumes
    full = torch.randn(n * m, generator=torch.Generator().manual_seed(7 + r)) * (1 + r % 3)
    every = torch.zeros(n, n * m)
    dist.all_gather_into_tensor(every.view(-1), full)
    work = quantized.start_reduce_scatter_hierarchical(full, inner, outer, bits=bits, block=block)
    work.wait()
    q_max = {8: 127, 4: 7}[bits]
    half = lambda t: t.view(-1, block).abs().amax(-1).repeat_interleave(block) / q_max / 2  # noqa: E731
    chunks = every.view(n, n, m)  # [source rank, chunk, element]
    node, local = divmod(r, h)
    bound = sum(half(chunks[j, r]) for j in range(n))  # level 1: every contribution's half-step
    for q2 in range(k):  # level 2: node q2's partial sum of this rank's chunk, re-quantized
        members = range(q2 * h, (q2 + 1) * h)
        partial = sum(chunks[j, r] for j in members)
        slack = sum(half(chunks[j, r]) for j in members)
        bound = bound + (partial.abs().view(-1, block).amax(-1).repeat_interleave(block) + slack.view(-1, block).amax(-1)
                         .repeat_interleave(block)) / q_max / 2
    exact = chunks[:, r].sum(0)
    err = (work.result - exact).abs()
    flat_bytes = (n - 1) * quantized.quantized_nbytes(m, bits, block)
    return {"ok": bool((err <= bound + 1e-5).all()), "err": float(err.max()), "levels": work.levels,
            "flat_bytes": flat_bytes, "node": node, "local": local}


@scenario("quant.zeropp")
def zeropp(ctx: ScenarioContext) -> None:
    """``runs``: ``{name: "gpt|llama[:qw=..,qg=..,hpz=..]"}`` (tests/quant/zeropp_runs.py); rank 0 writes OUT/<name>.pt."""
    from tests.quant.zeropp_runs import run_all

    run_all(ctx.params["runs"], str(ctx.out))
