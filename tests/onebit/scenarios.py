"""The scenarios of the 1-bit suite (tests/helpers/harness.py): each rank's ``result`` record."""

from __future__ import annotations

from typing import Any

from tests.helpers.harness import ScenarioContext, scenario


@scenario("onebit.allreduce")
def allreduce(ctx: ScenarioContext) -> dict[str, Any]:
    """No params: the compressed all-reduce against its oracle, and its bytes (allreduce_runs.py)."""
    from tests.onebit.allreduce_runs import run

    return run()


@scenario("onebit.train")
def train(ctx: ScenarioContext) -> dict[str, Any]:
    """``cases``: ``converge`` and/or ``resume`` (train_runs.py)."""
    from tests.onebit.train_runs import run

    return run(str(ctx.out), ctx.params["cases"])
