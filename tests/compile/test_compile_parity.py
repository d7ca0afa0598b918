"""torch.compile under every stage (issue #16): the example GPT, compiled, on 2 gloo ranks against compiled ddp.

One launch (scenario ``compile.compile``) trains every configuration in one process group (start-up dominates on 2 cores);
the tests only read the results. The compiled graphs come from a counting backend around
``aot_eager`` (and once around CPU inductor), so the tests see how often compiled code ran per step,
not only what dynamo compiled.
"""

from __future__ import annotations


import pytest

from tests.helpers.launch import run_worker

UNITS = ["model._orig_mod.blocks.0", "model._orig_mod.blocks.1", "model._orig_mod.blocks.2"]
PLAIN_UNITS = [u.replace("_orig_mod.", "") for u in UNITS]
RUNS = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "zero3_offload": "zero3:offload=1",
    "zero3_fullgraph": "zero3:compile=netfull",
    "zero3_method": "zero3:compile=method",
    "zero3_blocks_ac": "zero3:compile=blocks,ac=1",
    "zero3_option_ac": "zero3:compile=strategy,ac=1",
    "zero3_inductor": "zero3:compile=strategy,backend=inductor",
    "zero3_bf16": "zero3:precision=bf16-mixed",
    "zero3_bf16_eager": "zero3:precision=bf16-mixed,compile=none",
    "zero3_example": "zero3:compile=example",
    "pipe": "zero1:pp=2,compile=strategy",
    "pipe_example": "zero1:pp=2,compile=example",
    "pipe_eager": "zero1:pp=2,compile=none",
    "seq_ddp": "ddp:net=seq",
    "seq_zero3": "zero3:net=seq",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("compile")
    env = {"CUDA_VISIBLE_DEVICES": "", "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    return run_worker(tmp, 2, RUNS, timeout=900, scenario="compile.compile", env=env)


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload", "zero3_fullgraph", "zero3_method",
                                  "zero3_blocks_ac", "zero3_option_ac", "zero3_inductor", "zero3_example"])
def test_losses_match_compiled_ddp(runs: dict[str, dict], name: str) -> None:
    ref, got = runs["ddp"], runs[name]
    assert ref["graph_runs"] == [1] * len(ref["losses"])  # the oracle really ran compiled: one graph per step
    assert _max_diff(got["losses"], ref["losses"]) < 1e-3
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):  # every rank, not only rank 0
        assert _max_diff(r_got["losses"], r_ref["losses"]) < 1e-3


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_stages_below_3_compile_the_whole_network(runs: dict[str, dict], name: str) -> None:
    run = runs[name]
    assert run["graph_breaks"] == 0 and run["unique_graphs"] == 1
    assert run["graph_runs"] == [1] * len(run["losses"])
    assert run["calls_captured"] == runs["ddp"]["calls_captured"]


@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero3_fullgraph", "zero3_method", "zero3_blocks_ac",
                                  "zero3_option_ac", "zero3_inductor", "zero3_bf16", "zero3_example"])
def test_zero3_runs_every_unit_compiled_with_at_most_one_break_per_step(runs: dict[str, dict], name: str) -> None:
    run = runs[name]
    steps = len(run["losses"])
    assert run["graph_breaks"] <= steps, run["break_reasons"]  # the bound; in fact there are none
    assert run["graph_breaks"] == 0, run["break_reasons"]
    # the first batch runs eagerly (ReadWatch), then each of the 3 units enters its compiled graph once per
    # step, and so does each part of a whole-network compile outside the units (embeddings, dropout, norm)
    around = len(run["plan"]["compiled_around"]) if run["plan"] else 0
    assert run["graph_runs"] == [0] + [len(run["units"]) + around] * (steps - 1)
    assert len(run["units"]) == 3
    # one graph for all blocks (no recompilation per unit or per step), one per part around them
    assert run["unique_graphs"] == 1 + around


def test_users_whole_network_compile_moves_onto_the_units(runs: dict[str, dict]) -> None:
    """The units, and the modules of the compiled network outside them (the tied head is a ``F.linear`` in
    the network's own forward, which calls the units: eager)."""
    around = ["wte", "wpe", "drop", "ln_f"]
    for name in ("zero3", "zero3_fullgraph", "zero3_offload", "zero3_bf16"):
        plan = runs[name]["plan"]
        assert plan["made_eager"] == ["model"] and plan["compiled"] == UNITS == runs[name]["units"]
        assert plan["compiled_around"] == [f"model._orig_mod.{n}" for n in around]
    assert runs["zero3_method"]["plan"]["made_eager"] == ["model"]
    assert runs["zero3_method"]["plan"]["compiled"] == PLAIN_UNITS
    assert runs["zero3_method"]["plan"]["compiled_around"] == [f"model.{n}" for n in around]
    example = runs["zero3_example"]["plan"]  # the example's model.compile=true: its blocks, which are the units
    assert example["already_compiled"] == PLAIN_UNITS and example["made_eager"] == [] and example["compiled"] == []


def test_whole_network_compile_of_torch_nn_units_is_compiled_on_every_rank(runs: dict[str, dict]) -> None:
    """issue #27 item 2: ``self.net = torch.compile(net)`` of ``nn.Sequential(Linear, GELU, Linear)`` blocks,
    whose stage-3 units are the Linears (modules of torch.nn, which dynamo does not compile through
    ``_call_impl``): dynamo's own counters showed nothing captured on every zero3 rank, a silently eager
    run. Now every rank captures at least as many calls as compiled ddp's one graph, with no graph break,
    runs 8 compiled graphs per step (5 Linear units, 2 GELUs and the norm between them; the first batch
    is eager, [Note: first batches run eagerly]) and matches compiled ddp's losses."""
    ref, got = runs["seq_ddp"], runs["seq_zero3"]
    steps = len(got["losses"])
    assert ref["graph_runs"] == [1] * steps and ref["graph_breaks"] == 0
    assert got["plan"]["made_eager"] == ["net"] and len(got["plan"]["compiled"]) == len(got["units"]) == 5
    assert got["plan"]["compiled_around"] == ["net._orig_mod.0.0.1", "net._orig_mod.0.1.1", "net._orig_mod.1"]
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):
        assert r_ref["calls_captured"] > 0
        assert r_got["calls_captured"] >= r_ref["calls_captured"]
        assert r_got["graph_breaks"] <= steps and r_got["graph_breaks"] == 0
        assert r_got["graph_runs"] == [0] + [8] * (steps - 1)
        assert _max_diff(r_got["losses"], r_ref["losses"]) < 1e-3


def test_per_block_compile_and_the_compile_option(runs: dict[str, dict]) -> None:
    blocks = runs["zero3_blocks_ac"]["plan"]
    assert blocks["compiled"] == [] and blocks["made_eager"] == [] and blocks["already_compiled"] == PLAIN_UNITS
    option = runs["zero3_option_ac"]["plan"]
    assert option["compiled"] == PLAIN_UNITS and option["made_eager"] == []


def test_activation_checkpointing_recomputes_inside_the_compiled_units(runs: dict[str, dict]) -> None:
    """Under activation checkpointing each unit's compiled forward runs again in backward: the counts
    between two training steps include those recomputations."""
    for name in ("zero3_blocks_ac", "zero3_option_ac"):
        assert runs[name]["graph_runs"][1:] == [3] * (len(runs[name]["losses"]) - 1)
    assert _max_diff(runs["zero3_option_ac"]["losses"], runs["zero3"]["losses"]) < 1e-5


def test_mixed_precision_compiled_matches_eager(runs: dict[str, dict]) -> None:
    compiled, eager = runs["zero3_bf16"], runs["zero3_bf16_eager"]
    assert eager["graph_runs"] == [0] * len(eager["losses"])
    assert _max_diff(compiled["losses"], eager["losses"]) < 1e-3
    assert _max_diff(compiled["losses"], runs["zero3"]["losses"]) > 0  # bf16 really ran (not fp32)


@pytest.mark.parametrize("name", ["pipe", "pipe_example"])
def test_pipeline_stages_compile_their_layers(runs: dict[str, dict], name: str) -> None:
    """2 pipeline stages (dp 1): the strategy's option compiles the stage's layers, the example its blocks."""
    compiled, eager = runs[name], runs["pipe_eager"]
    assert _max_diff(compiled["losses"], eager["losses"]) < 1e-3
    if name == "pipe":
        assert compiled["plan"]["compiled"] and all(".layers." in n for n in compiled["plan"]["compiled"])
    assert all(r["graph_runs"] and min(r["graph_runs"]) > 0 for r in compiled["per_rank"])  # every step, both stages
    assert sum(eager["graph_runs"]) == 0
    assert compiled["graph_breaks"] == 0
