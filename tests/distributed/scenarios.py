"""The scenarios of the distributed suite (tests/helpers/harness.py): the ParityNet runs against ddp, the
units skipped by data-dependent control flow, and the sharded init under zero3."""

from __future__ import annotations

from typing import Any

from tests.helpers.harness import ScenarioContext, scenario
from tests.helpers.worker_io import run_specs


@scenario("distributed.parity")
def parity(ctx: ScenarioContext) -> None:
    """``runs``: ``{name: "ddp" | "zeroK[:key=value,...]"}`` (tests/helpers/parity_runs.py)."""
    from tests.helpers.parity_runs import run

    run_specs(run, ctx)


@scenario("distributed.skipped_units")
def skipped_units(ctx: ScenarioContext) -> None:
    """No params; rank 0 writes ``OUT/<run>.pt`` (tests/distributed/skip_runs.py)."""
    from tests.distributed.skip_runs import run

    run(str(ctx.out))


@scenario("distributed.sharded_init")
def sharded_init(ctx: ScenarioContext) -> dict[str, Any]:
    """No params; each rank's ``result``: its peak memory beside the full model's size (sharded_init.py)."""
    from tests.distributed.sharded_init import run

    return run()


@scenario("distributed.hf_init")
def hf_init(ctx: ScenarioContext) -> dict[str, Any]:
    """``pretrained_dir``: a tiny Llama's save_pretrained folder; each rank's ``result``: see hf_init.py."""
    from tests.distributed.hf_init import run

    return run(ctx.world_size, ctx.params["pretrained_dir"])


@scenario("distributed.released_state")
def released_state(ctx: ScenarioContext) -> dict[str, Any]:
    """``spec``: "zero3" or "zero3_offload"; each rank's ``result``: tests/distributed/released_state.py."""
    from tests.distributed.released_state import run

    return run(ctx.params["spec"])


@scenario("distributed.sync_batchnorm")
def sync_batchnorm(ctx: ScenarioContext) -> dict[str, Any]:
    """``specs``: a list of tests/distributed/sync_batchnorm.py specs, run in order; each rank's ``result``:
    ``{spec: what run(spec) returned}``."""
    from tests.distributed.sync_batchnorm import run

    return {spec: run(spec) for spec in ctx.params["specs"]}


@scenario("distributed.after_fit")
def after_fit(ctx: ScenarioContext) -> dict[str, Any]:
    """``specs``: tests/distributed/after_fit.py SPECS names, run in order; each rank's ``result``: ``{spec: run(spec)}``."""
    from tests.distributed.after_fit import run

    return {spec: run(spec, str(ctx.out)) for spec in ctx.params["specs"]}
