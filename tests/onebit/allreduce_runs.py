"""Scenario ``onebit.allreduce`` (tests/onebit/scenarios.py): the compressed all-reduce across real gloo
processes against the one-process oracle. Every rank draws every
rank's inputs from fixed seeds, runs the real exchange on its own input (several rounds, so the
error buffers matter), runs the oracle for all ranks, and compares its result and error buffers
bit for bit. Then it counts the bytes one exchange hands to torch.distributed. Every rank returns
the findings (recorded as ``result``).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.comm.compressed import (  # noqa: E402
    ErrorFeedback,
    TorchDistBackend,
    make_compressor,
    simulate_onebit_allreduce,
)
from tests.onebit.bytecount import count_collectives  # noqa: E402

ROUNDS = 3


def inputs_for(world: int, numel: int, round_: int) -> list[torch.Tensor]:
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(7919 * numel + 104729 * round_ + r)
        # mixed magnitudes and exact zeros, as real momentum has
        x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel).roll(r)
        x[:: 11] = 0.0
        out.append(x)
    return out


def check_exact(numel: int, block: int, compressor_name: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    backend = TorchDistBackend(None, compressor=make_compressor(compressor_name), block=block)
    mine = backend.new_errors(numel, torch.device("cpu"))
    sims = [ErrorFeedback.zeros(mine.layout, torch.device("cpu")) for _ in range(world)]
    mismatches = []
    for round_ in range(ROUNDS):
        xs = inputs_for(world, numel, round_)
        expected = simulate_onebit_allreduce(xs, sims, backend.compressor)
        got = xs[rank].clone()
        backend.compressed_average_(got, mine)
        for what, a, b in (
            ("result", got, expected[rank]),
            ("worker_error", mine.worker, sims[rank].worker),
            ("server_error", mine.server, sims[rank].server),
        ):
            if not torch.equal(a, b):
                mismatches.append(f"{what} round {round_}: max diff {(a - b).abs().max().item():.3e}")
    return {"numel": numel, "block": block, "compressor": compressor_name, "layout": mine.layout,
            "mismatches": mismatches}


def count_bytes(numel: int) -> dict:
    backend = TorchDistBackend(None, compressor=make_compressor("kernel"))
    errors = backend.new_errors(numel, torch.device("cpu"))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    backend.compressed_average_(x.clone(), errors)  # warm (first-call allocations, kernel load)
    with count_collectives() as compressed:
        backend.compressed_average_(x.clone(), errors)
    with count_collectives() as plain:
        C.all_reduce(x.to(torch.bfloat16), None, "sum")
    return {
        "numel": numel, "compressed_wire": compressed.wire, "compressed_handed": compressed.handed,
        "plain_wire": plain.wire, "plain_handed": plain.handed, "calls": compressed.calls,
        "backend_bytes_sent": backend.counters.bytes_sent / 2,  # two exchanges ran through this backend
    }


def run() -> dict:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cases = []
    small = [1, 5, 8 * world * 3 + 5, 4099]  # lengths that are not multiples of 8 x world size
    for numel in small:
        for block in (16, 1024):
            cases.append(check_exact(numel, block, "torch"))
    for numel, block in [(5, 1024), (8 * world * 3 + 5, 1024), (4099, 16), (100_003, 1024)]:
        cases.append(check_exact(numel, block, "kernel"))
    result = {"world": world, "cases": cases, "bytes": count_bytes(1 << 20)}
    dist.barrier()
    dist.destroy_process_group()
    return result
