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
        return out
    finally:
        dist.destroy_process_group()
