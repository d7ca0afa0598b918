"""Pipelined ZeroStrategy against the same LightningModule trained on one process (CPU, gloo, fp32).

One ``torchrun`` per world size trains every configuration in one process group (start-up is the
expensive part on a 2-core machine); the references run in this process; the tests only compare.
Model: a tied embedding, 4 blocks (5 for the uneven split), a LayerNorm and the embedding as head.
Global batch 8 for every run, gradient clipping at 0.5 (so the global norm must count tied weights
once), AdamW with two param groups and an LR scheduler, 20 steps.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_worker
from tests.pipeline.pipe_model import GradNormProbe, PipeNet, RandomTokens
from tests.helpers.compare import max_rel as _rel

TOL = 1e-4


def _launch(tmp: Path, nproc: int, runs: dict[str, str]) -> dict[str, dict]:
    return run_worker(tmp, nproc, runs, timeout=900, scenario="pipeline.pipe")


def _reference(blocks: int = 4, steps: int = 20, accumulate: int = 1, carry: bool = False) -> dict:
    """The same LightningModule on one process: Lightning's single-device strategy, layers in sequence."""
    import lightning.pytorch as pl

    warnings.filterwarnings("ignore")
    pl.seed_everything(0, workers=True)
    model = PipeNet(blocks=blocks, carry=carry)
    probe = GradNormProbe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=0.5, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=1, limit_val_batches=2, use_distributed_sampler=False, callbacks=[probe],
    )
    trainer.fit(model)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": model.losses, "val_losses": model.val_losses, "grad_norms": probe.norms, "weights": weights}


@pytest.fixture(scope="module")
def refs() -> dict[str, dict]:
    return {"4": _reference(4), "5": _reference(5), "4acc": _reference(4, steps=10, accumulate=2),
            "4carry": _reference(4, steps=10, carry=True)}


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {
        "p2_1f1b": "stages=2,schedule=1f1b,micro=4,ckpt=1,count=1",
        "p2_gpipe": "stages=2,schedule=gpipe,micro=4,ckpt=1,fmt=full",
        "p2_uneven": "stages=2,schedule=1f1b,micro=2,blocks=5,count=1",
        "p2_interleaved": "stages=2,schedule=interleaved,virtual=2,micro=4,ckpt_interval=1,count=1",
        "p2_compiled": "stages=2,schedule=interleaved,virtual=2,micro=4,ckpt_interval=1,compile=aot_eager",
        "p2_zero0_accum": "stages=2,stage=0,micro=2,accumulate=2,steps=10,partition=uniform",
        "p2_resume": "stages=2,micro=4,resume=1",
        "p2_resume_p1": "stages=2,micro=4,resume=1,resume_stages=1",
        "p1_zero2": "stages=1,stage=2",
        "p2_bf16": "stages=2,precision=bf16-mixed,steps=10",
        "bad_layers": "stages=2,expect=layers",
        "bad_batch": "stages=2,micro=4,expect=batch",
    }
    return _launch(tmp_path_factory.mktemp("pipe2"), 2, runs)


@pytest.fixture(scope="module")
def four_procs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {
        "p2x2_1f1b": "stages=2,schedule=1f1b,micro=2",
        "p2x2_gpipe": "stages=2,schedule=gpipe,micro=2",
        "p4_1f1b": "stages=4,schedule=1f1b,micro=4,count=1",
        "p4_carry": "stages=4,schedule=1f1b,micro=4,carry=1,count=1,steps=10",
    }
    return _launch(tmp_path_factory.mktemp("pipe4"), 4, runs)


def _dp_mean_losses(run: dict, stages: int) -> list[float]:
    """Mean over the data-parallel ranks of stage 0 (ranks 0..dp-1): the loss of the global batch."""
    per = run["per_rank"]
    dp = len(per) // stages
    return [sum(per[r]["losses"][i] for r in range(dp)) / dp for i in range(len(per[0]["losses"]))]


def _check_run(run: dict, ref: dict, stages: int) -> None:
    losses = _dp_mean_losses(run, stages)
    assert len(losses) == len(ref["losses"])
    assert _rel(losses, ref["losses"]) < TOL
    assert _rel(run["grad_norms"], ref["grad_norms"]) < TOL  # tied embedding counted once in the norm
    assert _rel(run["val_losses"], ref["val_losses"]) < TOL  # sanity check through the pipeline, 6 = 2+2+1+1
    per = run["per_rank"]
    dp = len(per) // stages
    for r in range(len(per)):  # every rank returns its pipeline's loss
        assert per[r]["losses"] == per[r % dp]["losses"]
    weights = run["weights"]  # merged on rank 0 from every stage, under the un-pipelined names
    assert set(weights) == set(ref["weights"])
    bad = {k: v for k, v in weights.items() if float((v - ref["weights"][k]).norm() / ref["weights"][k].norm()) > TOL}
    assert not bad, sorted(bad)
    # each stage holds a strict subset of the layers, and together they hold all of them
    keys = [set(p["local_keys"]) for p in per]
    assert all(k < set(ref["weights"]) for k in keys) or stages == 1
    assert set().union(*keys) == set(ref["weights"])


@pytest.mark.parametrize("name", ["p2_1f1b", "p2_gpipe", "p2_interleaved"])
def test_two_stages_match_one_process(two_procs: dict, refs: dict, name: str) -> None:
    _check_run(two_procs[name], refs["4"], stages=2)


def test_same_module_without_pipeline_under_zero2(two_procs: dict, refs: dict) -> None:
    """pipeline_stages=1: the PipelineModule runs its layers in sequence; ZeRO-2 over 2 data-parallel ranks."""
    run = two_procs["p1_zero2"]
    _check_run(run, refs["4"], stages=1)
    assert run["bubble"] is None


def test_uneven_split_matches_one_process(two_procs: dict, refs: dict) -> None:
    run = two_procs["p2_uneven"]
    _check_run(run, refs["5"], stages=2)
    blocks = [sum(".down.weight" in k for k in p["local_keys"]) for p in run["per_rank"]]
    assert sorted(blocks) == [2, 3]  # 5 blocks on 2 stages


def test_zero0_with_gradient_accumulation(two_procs: dict, refs: dict) -> None:
    _check_run(two_procs["p2_zero0_accum"], refs["4acc"], stages=2)


@pytest.mark.parametrize("name", ["p2x2_1f1b", "p2x2_gpipe"])
def test_two_stages_by_two_data_parallel(four_procs: dict, refs: dict, name: str) -> None:
    _check_run(four_procs[name], refs["4"], stages=2)


def test_four_stages(four_procs: dict, refs: dict) -> None:
    _check_run(four_procs["p4_1f1b"], refs["4"], stages=4)


def test_tensors_passed_through_stages_are_not_overwritten(four_procs: dict, refs: dict) -> None:
    """Blocks pass a second tensor on unchanged: the middle stages send on the buffer they received it in, and
    its gradient lands in their input's .grad; reusing those buffers for the next micro-batch while the sends
    are in flight would corrupt them (pipeline/buffers.py [Note: reused receive buffers])."""
    run = four_procs["p4_carry"]
    _check_run(run, refs["4carry"], stages=4)
    allocating = [any(step.get("empty") for step in rank["allocations"][1:]) for rank in run["per_rank"]]
    assert allocating == [False, True, True, False], run["per_rank"]  # the middle stages' aliased buffers: not reused


def test_bf16_activations_and_gradients_cross_stages(two_procs: dict, refs: dict) -> None:
    """bf16-mixed: 16-bit activations, gradients and tied-gradient sums between the stages."""
    run = two_procs["p2_bf16"]
    assert _rel(run["losses"], refs["4"]["losses"][:10]) < 2e-2
    assert _rel(run["grad_norms"], refs["4"]["grad_norms"][:10]) < 5e-2


@pytest.mark.parametrize("name", ["p2_1f1b", "p2_gpipe"])
def test_checkpoint_loads_into_unpipelined_model(two_procs: dict, refs: dict, name: str, tmp_path: Path) -> None:
    """p2_1f1b saves sharded (each stage writes its own layers; consolidated here into one plain file),
    p2_gpipe saves the full format (gathered on rank 0)."""
    from lightning_zero.checkpoint import consolidate, is_sharded_checkpoint

    run = two_procs[name]
    path = run["ckpt"]
    sharded = is_sharded_checkpoint(path)
    assert sharded == (name == "p2_1f1b")
    if sharded:
        path = consolidate(path, tmp_path / "plain.ckpt", progress=False)
    ckpt = torch.load(path, weights_only=False)
    plain = PipeNet(blocks=4)
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    for k, v in plain.state_dict().items():
        assert torch.allclose(v, refs["4"]["weights"][k], rtol=1e-4, atol=1e-6), k
    with torch.no_grad():
        expected = plain.pipe.predict(RandomTokens(6, seed=5).data[:, :-1])
    for rank in run["per_rank"]:  # pipe.predict: the last stage's outputs, on every rank
        assert torch.allclose(rank["predict"], expected, rtol=1e-4, atol=1e-5)
    opt = ckpt["optimizer_states"][0]
    if sharded:  # the stages' states merged into torch's per-parameter format of the plain model
        n_params = len({id(p) for p in plain.parameters()})
        assert len(opt["state"]) == n_params and all("exp_avg" in s for s in opt["state"].values())
    else:
        assert opt["pipeline_stages"] == 2 and len(opt["stages"]) == 2
        assert all(s["state"] for s in opt["stages"])  # every stage's Adam moments are in the file


@pytest.mark.parametrize("name", ["p2_resume", "p2_resume_p1"])
def test_resume_continues_with_the_same_losses(two_procs: dict, name: str) -> None:
    """p2_resume_p1: a sharded checkpoint of 2 pipeline stages (stage 1 holds the optimizer state of
    its layers) resumes without pipeline stages on the same 2 ranks (each holds all layers, the state
    partitioned by ZeRO-1 instead); the keys name layers, not stages."""
    run = two_procs[name]
    resumed = run["resumed_losses"]
    if name == "p2_resume_p1":  # each of the 2 data-parallel ranks now sees half of the global batch
        halves = [r["resumed_losses"] for r in run["per_rank"]]
        resumed = [(a + b) / 2 for a, b in zip(*halves)]
    assert len(resumed) == 10
    assert _rel(resumed, run["losses"][10:]) < TOL


def test_bubble_is_reported(two_procs: dict) -> None:
    bubble = two_procs["p2_1f1b"]["bubble"]
    assert bubble["theoretical"] == pytest.approx(1 / 5)
    assert 0.0 <= bubble["measured"] <= 1.0 and 0.0 <= bubble["measured_stage"] <= 1.0
    assert two_procs["p2_interleaved"]["bubble"]["theoretical"] == pytest.approx(1 / 9)


def test_more_stages_than_layers_fails_before_training(two_procs: dict) -> None:
    run = two_procs["bad_layers"]
    assert "1 layer(s) but the pipeline has 2 stage(s)" in run["error"]
    assert all(p["error"] == run["error"] for p in run["per_rank"])


def test_batch_not_divisible_by_microbatches_fails_before_training(two_procs: dict) -> None:
    run = two_procs["bad_batch"]
    assert "batch_size=6 is not divisible by microbatches=4" in run["error"]
    assert run["trained_losses"] == []


def _steady_counts(run: dict) -> list[dict[str, int]]:
    """Per rank, the allocations, fills and host reads of a training step, the same in every step after the first (which
    allocates the receive buffers and exchanges the activation shapes): validation between steps included."""
    out = []
    for rank in run["per_rank"]:
        steps = rank["allocations"]
        assert len(steps) == len(rank["losses"]) > 2
        assert all(c == steps[1] for c in steps[2:]), steps
        out.append(steps[1])
    return out


def test_no_allocation_or_fill_per_microbatch(two_procs: dict, four_procs: dict) -> None:
    """What the host dispatches per step besides the layers' own ops (each fill is a kernel or a memset on a
    GPU): receive buffers come back from pipeline/buffers.py, the loss gradient is one cached tensor, so a
    steady-state step allocates no receive buffer and fills nothing per micro-batch, on every stage:
    2 micro-batches dispatch what 4 do. The fills left are per step: the loss all-reduce buffer and the zero
    leaf Lightning's backward runs on (runtime.py [Note: Lightning's backward]). Nothing in a step, the exchanges
    included, reads a device value on the host (``.item()``, ``bool(t)``: each a device synchronisation)."""
    from tests.pipeline.pipe_model import ALLOC_OPS, FILL_OPS, SYNC_OPS

    m2, m4 = _steady_counts(two_procs["p2_uneven"]), _steady_counts(two_procs["p2_1f1b"])
    assert m2 == m4  # first stage, last stage: nothing grows with the micro-batches
    for run in (two_procs["p2_1f1b"], two_procs["p2_interleaved"], four_procs["p4_1f1b"]):
        for counts in _steady_counts(run):  # middle stages of p4 receive activations and gradients
            assert sum(v for k, v in counts.items() if k in ALLOC_OPS) == 0, counts
            assert sum(v for k, v in counts.items() if k in FILL_OPS) <= 2, counts
            assert sum(v for k, v in counts.items() if k in SYNC_OPS) == 0, counts  # the host never waits


def test_compiled_stages_match_one_process(two_procs: dict, refs: dict) -> None:
    """ZeroStrategy(compile=True) under the pipeline (interleaved, activation checkpointing): each rank compiles
    the blocks it holds (zero/compile.py), fullgraph, and trains as the eager single process does."""
    run = two_procs["p2_compiled"]
    _check_run(run, refs["4"], stages=2)
    for rank in run["per_rank"]:
        assert rank["compiled"] and all(".layers." in n for n in rank["compiled"])
        assert rank["calls_captured"] > 0 and rank["graph_breaks"] == 0
