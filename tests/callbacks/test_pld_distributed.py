"""Progressive Layer Dropping on 2 gloo ranks (issue #19): both ranks drop the same layers under
zero3 and ddp, with no communication; zero3 trains like ddp until the first drop. After it they part:
ddp leaves a dropped layer's gradient None (AdamW skips those parameters), ZeRO's flat buffers hold a
zero gradient (AdamW steps them with their momentum and weight decay), as DeepSpeed does."""

from __future__ import annotations

import math

import pytest

from tests.profiler.dist_runs import dist_results


def test_every_rank_drops_the_same_layers_under_zero3_and_ddp() -> None:
    runs = dist_results()
    plans = [rec["keep"] for name in ("pld_zero3", "pld_ddp") for rec in runs[name]]
    assert len(plans[0]) == 8 and all(p == plans[0] for p in plans)
    assert any(not all(step) for step in plans[0])  # layers were dropped


def test_zero3_with_pld_trains_like_ddp_up_to_the_first_drop() -> None:
    runs = dist_results()
    first_drop = next(i for i, step in enumerate(runs["pld_zero3"][0]["keep"]) if not all(step))
    for rank in (0, 1):
        z3, ddp = runs["pld_zero3"][rank]["losses"], runs["pld_ddp"][rank]["losses"]
        assert len(z3) == len(ddp) == 8 and all(math.isfinite(x) for x in z3)
        assert z3[: first_drop + 1] == pytest.approx(ddp[: first_drop + 1], rel=1e-5)
        assert z3 == pytest.approx(ddp, rel=1e-2)
