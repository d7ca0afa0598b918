"""The scenarios of the 16-bit device states suite (tests/helpers/harness.py): ``states16.runs``, several
ParityNet runs in one process group (tests/states16/runs.py), each rank recording its own figures."""

from __future__ import annotations

from tests.helpers.harness import ScenarioContext, scenario


@scenario("states16.runs")
def runs(ctx: ScenarioContext) -> None:
    """``runs``: ``{name: spec}`` (runs.py ``SPECS`` says what each kind does); each rank records ``name``."""
    from tests.states16.runs import run

    for name, spec in ctx.params["runs"].items():
        ctx.record(name, run(name, spec, str(ctx.out)))
