"""The strategy option on 2 gloo ranks (issue #19): ``ZeroStrategy(stage=3, activation_offload=True)``
checkpoints every stage-3 unit with its checkpoint offloaded, trains bitwise like without it, and
the recomputation in backward does not make any unit resident (gathered for whole steps)."""

from __future__ import annotations

import torch

from tests.profiler.dist_runs import dist_results


def test_zero3_activation_offload_is_bitwise_the_run_without_it() -> None:
    runs = dist_results()
    for rank in (0, 1):
        on, off = runs["act_zero3"][rank], runs["noact_zero3"][rank]
        assert on["checkpointed"] == [True] * 4 and off["checkpointed"] == [False] * 4
        assert on["packed"] == 4 * 4  # four steps, one checkpoint per unit
        assert on["resident"] == [False] * 4
        assert len(on["losses"]) == 4
        assert all(torch.equal(a, b) for a, b in zip(on["losses"], off["losses"]))
