"""The scenarios of the profiler suite (tests/helpers/harness.py)."""

from __future__ import annotations

from tests.helpers.harness import ScenarioContext, scenario


@scenario("profiler.dist")
def dist(ctx: ScenarioContext) -> None:
    """No params: issue #19's distributed checks, every rank records each run (dist_checks.py)."""
    from tests.profiler.dist_checks import run

    run(str(ctx.out))
