"""Pipeline x tensor parallel x ZeRO-1 against one process (CPU, gloo, fp32; issue #17 item 4).

A Llama-style PipelineModule (tests/parallel/pp_tp_model.py: tied embedding/head, 2 blocks of
grouped-query attention and SwiGLU, one block per stage), parallelized per stage in configure_model
with ``stage_plan``; ``ZeroStrategy(stage=1, pipeline_stages=2, tensor_parallel=2)`` on 4 processes
(pp 2 x tp 2 x dp 1) through the Trainer, fixed global batch 8 in 4 micro-batches, AdamW, clipping at a
norm that binds (so the norm must sum TP-sharded pieces over tp, count replicated and tied weights
once and sum the stages), 6 steps; under 1F1B, GPipe (ZeRO-0) and the interleaved schedule (2 virtual
stages per rank, the model cut in four: pp_tp_model.INTERLEAVED_PARTITION). The oracle is the same
LightningModule on Lightning's single-device strategy (layers in sequence, no mesh); a bf16-mixed run
is held to it within bf16's precision.
Checkpoints: a pp 2 x tp 2 run saved after 3 steps (sharded directory; full file) holds the one-process
weights (full_state_dict, offline consolidation) and resumes on pp 2 x tp 2, pp 1 x tp 2 x dp 2 and
pp 2 x tp 1 x dp 2 as the one-process run resumes. pp 2 x tp 2 x dp 2 needs 8 processes: not run on
CI's 2 cores (checked by hand: norms within 7e-7, weights within 1e-5 of the oracle).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers.launch import run_worker
from tests.parallel.pp_tp_model import PPTPNet
from tests.pipeline.pipe_model import GradNormProbe
from tests.helpers.compare import max_rel as _rel

TOL = 1e-4
SCENARIO = "parallel.pp_tp"


def _single_process(steps: int, ckpt: Optional[Path] = None, save: Optional[Path] = None) -> dict:
    """The same LightningModule on Lightning's single-device strategy (layers in sequence, no mesh)."""
    import lightning.pytorch as pl

    warnings.filterwarnings("ignore")
    pl.seed_everything(0, workers=True)
    model = PPTPNet()
    probe = GradNormProbe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=0.3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=[probe],
    )
    trainer.fit(model, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return {"losses": model.losses, "grad_norms": probe.norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def reference() -> dict:
    return _single_process(6)


@pytest.fixture(scope="module")
def reference_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """3 steps, a checkpoint, a resume to step 6 (Lightning restarts the epoch's data: the oracle does too)."""
    path = tmp_path_factory.mktemp("pptp_ref") / "ref.ckpt"
    saved = _single_process(3, save=path)
    return {"saved": saved, "resumed": _single_process(6, ckpt=path)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {"pp2_tp2": "pp=2,tp=2,stage=1", "pp2_tp2_gpipe_zero0": "pp=2,tp=2,stage=0,schedule=gpipe",
            "pp2_tp2_interleaved": "pp=2,tp=2,stage=1,schedule=interleaved,virtual=2",
            "pp2_tp2_bf16": "pp=2,tp=2,stage=1,precision=bf16-mixed",
            "save_sharded": "pp=2,tp=2,save=sharded", "save_full": "pp=2,tp=2,save=full,fmt=full",
            "resume_same": "pp=2,tp=2,resume=sharded", "resume_pp1_tp2_dp2": "pp=1,tp=2,resume=sharded",
            "resume_full_pp2_tp1_dp2": "pp=2,tp=1,resume=full"}
    return run_worker(tmp_path_factory.mktemp("pptp"), 4, runs, timeout=900, scenario=SCENARIO)


@pytest.mark.parametrize("name", ["pp2_tp2", "pp2_tp2_gpipe_zero0", "pp2_tp2_interleaved"])
def test_pp2_x_tp2_matches_one_process(four_ranks: dict[str, dict], reference: dict, name: str) -> None:
    """Per step: losses, clipped global norms; final weights; every rank returns the global loss."""
    got = four_ranks[name]
    assert _rel(got["losses"], reference["losses"]) < TOL
    assert _rel(got["grad_norms"], reference["grad_norms"]) < TOL
    assert min(reference["grad_norms"]) > 0.3  # clipping bound at every step
    assert set(got["weights"]) == set(reference["weights"])
    for n, w in reference["weights"].items():
        rel = float((got["weights"][n].double() - w.double()).norm() / w.double().norm())
        assert rel < TOL, (n, rel)
    for r in got["per_rank"]:  # every rank of the pipeline returns the global loss
        assert _rel(r["losses"], reference["losses"]) < TOL


def test_bf16_mixed_tracks_fp32(four_ranks: dict[str, dict], reference: dict) -> None:
    """16-bit activations cross the stages and TP weights step in bf16 (measured: losses within 3e-3,
    weights within 2% of the fp32 oracle; with the TP weights frozen by a broken cast the loss stays at
    its start, 28 instead of 12)."""
    got = four_ranks["pp2_tp2_bf16"]
    assert _rel(got["losses"], reference["losses"]) < 1e-2
    for n, w in reference["weights"].items():
        assert float((got["weights"][n].double() - w.double()).norm() / w.double().norm()) < 0.05, n


def test_layout_and_stage_shards(four_ranks: dict[str, dict]) -> None:
    """Ranks are (pp, dp, tp) with tp innermost; each stage's block is split over its two tp ranks."""
    per_rank = four_ranks["pp2_tp2"]["per_rank"]
    assert [r["coords"] for r in per_rank] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert all(r["tp_params"] == 7 for r in per_rank)  # q, k, v, o, gate, up, down of the stage's block
    assert per_rank[0]["local_numel"] == per_rank[1]["local_numel"]


def test_interleaved_holds_two_chunks_per_rank(four_ranks: dict[str, dict]) -> None:
    """The interleaved run really ran 2 virtual stages per rank (pp_tp_model.INTERLEAVED_PARTITION): a
    TP block on every rank, each in its second chunk on rank 0 and its first on rank 1."""
    per_rank = four_ranks["pp2_tp2_interleaved"]["per_rank"]
    assert [r["chunks"] for r in per_rank] == [2, 2, 2, 2]
    assert all(r["tp_params"] == 7 for r in per_rank)
    assert [r["chunks"] for r in four_ranks["pp2_tp2"]["per_rank"]] == [1, 1, 1, 1]


def _close(got: dict, want: dict, tol: float = TOL) -> None:
    assert set(got) == set(want)
    for n, w in want.items():
        rel = float((got[n].double() - w.double()).norm() / w.double().norm())
        assert rel < tol, (n, rel)


@pytest.mark.parametrize("name", ["save_sharded", "save_full"])
def test_checkpoint_holds_the_full_model(four_ranks: dict[str, dict], reference_resumed: dict, name: str) -> None:
    """What pp 2 x tp 2 writes: full_state_dict (TP blocks gathered over tp, stages merged) and, for the
    sharded directory, its offline consolidation are the one-process weights by the same names."""
    got, want = four_ranks[name], reference_resumed["saved"]["weights"]
    _close(got["saved_weights"], want)
    _close({k: v for k, v in got["full_state_dict"].items()}, want)
    if name == "save_sharded":
        _close(got["consolidated"], want)


@pytest.mark.parametrize("name", ["resume_same", "resume_pp1_tp2_dp2", "resume_full_pp2_tp1_dp2"])
def test_resume_across_layouts(four_ranks: dict[str, dict], reference_resumed: dict, name: str) -> None:
    """A pp 2 x tp 2 checkpoint (sharded; full file) resumes on the same layout, on pp 1 x tp 2 x dp 2 and
    on pp 2 x tp 1 x dp 2 with the one-process run's gradient norms and weights (issue #17 item 5 in 3D)."""
    got, want = four_ranks[name], reference_resumed["resumed"]
    assert _rel(got["grad_norms"], want["grad_norms"]) < TOL
    _close(got["weights"], want["weights"])
    if name == "resume_same":  # one replica: the pipeline's loss is the global one
        assert _rel(got["losses"], want["losses"]) < TOL
