"""The scenarios of the user-optimizer suite (tests/helpers/harness.py)."""

from __future__ import annotations

from tests.helpers.harness import ScenarioContext, scenario


@scenario("user_optim.parity")
def parity(ctx: ScenarioContext) -> None:
    """``cases``: ``{case: {opt, sched, skip, steps, resume}}``, ``kinds``: ddp and the ZeRO kinds (runs.py)."""
    from tests.user_optim.runs import run

    run(ctx.params, str(ctx.out))
