"""The scenarios of the fault suite (tests/helpers/harness.py). Each imports its module only when it runs:
``faults.plan`` tags every output line with the rank from its module's first lines on, which must not reach the
other scenario's processes."""

from __future__ import annotations

from tests.helpers.harness import ScenarioContext, scenario


@scenario("faults.plan")
def plan(ctx: ScenarioContext) -> None:
    """``plan``: the fits of tests/faults/fault_runs.py, one injected fault each (launched by launch.py)."""
    from tests.faults.fault_runs import run_plan

    run_plan(str(ctx.out), ctx.params["plan"])


@scenario("faults.nonfinite")
def nonfinite(ctx: ScenarioContext) -> None:
    """``plan``: the non-finite and failed-save cases of tests/faults/nonfinite_runs.py."""
    from tests.faults.nonfinite_runs import run_plan

    run_plan(str(ctx.out), ctx.params["plan"])
