"""Lightning callbacks and Trainer flags that change the optimizer or the parameters mid-training, under each
ZeRO stage against Lightning's ``ddp`` (fp32, 2 gloo ranks, one launch: tests/callbacks/scenarios.py).

What trains as under ddp must match it to TOL (losses per step on every rank, final weights); what the
engines cannot follow must be refused with its one-sentence reason (trainer_checks.py [Note: callbacks
that edit parameters or param groups mid-training], zero/engine.py ``check_param_groups``, zero/grad_window.py
[Note: gradients in the hooks before the step]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.helpers.compare import max_rel, tensor_rel
from tests.helpers.harness import ScenarioRun, run_scenario

TOL = 1e-4
STAGES = ["zero1", "zero2", "zero3", "zero3_offload"]
PARITY = ["freeze_then_unfreeze", "clip_norm_acc3", "clip_value_acc3", "accumulation_scheduler", "lr_find", "ckpt_best",
          "module_clip", "manual_clip", "lr_finder_callback"]
REFUSED = {  # case -> (specs, what the error says)
    "backbone_finetuning": (["zero2", "zero3"], "unfreezes parameters and adds optimizer param groups"),
    "swa": (["zero1", "zero3"], "StochasticWeightAveraging reads and overwrites the module's parameters"),
    "ema": (["zero2", "zero3_offload"], "EMAWeightAveraging reads the module's parameters after every step"),
    "pruning": (["zero1", "zero3"], "ModelPruning re-registers the pruned parameters"),
    "unfreeze_midway": (STAGES, "'backbone.0.weight' was frozen (requires_grad=False) when the ZeRO strategy set up"),
    "clip_value_partial": (["zero2_partial"], "gradient_clip_algorithm='value' is not supported with offload_ratio < 1"),
    "scale_batch_size": (["zero2"], "Tuning the batch size is currently not supported with distributed strategies"),
    # zero/grad_window.py [Note: gradients in the hooks before the step]
    "torch_clip": (STAGES, "The gradient of 'backbone.0.weight' was used (linalg_vector_norm) between backward"),
    "grad_edit": (["zero1", "zero3"], "The gradient of 'backbone.0.weight' was used (mul_) between backward"),
    "manual_torch_clip": (["zero2", "zero3_offload"], "'backbone.0.weight' was used (linalg_vector_norm) between"),
}
RUNS: dict[str, list[str]] = {
    **{case: ["ddp", *STAGES] for case in PARITY},
    "noclip_acc3": ["ddp"],
    "torch_clip": ["ddp", *STAGES],  # ddp: torch's clip changes the run there (so the refusal matters)
    "manual_torch_clip": ["ddp", "zero2", "zero3_offload"],
    **{case: specs for case, (specs, _) in REFUSED.items() if case not in ("torch_clip", "manual_torch_clip")},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], dict[str, Any]]:
    launch: ScenarioRun = run_scenario("callbacks.train", nprocs=2, params={"runs": RUNS}, timeout=600,
                                       out=Path(tmp_path_factory.mktemp("callbacks")), env={"CUDA_VISIBLE_DEVICES": ""})

    def get(case: str, spec: str) -> dict[str, Any]:
        got = launch.ranks(f"{case}.{spec}")[0]
        if got is None:
            raise AssertionError(f"{case}/{spec}: no result (worker {launch.how()}):\n{launch.log[-6000:]}")
        return got

    return get


def _ok(run: dict[str, Any]) -> dict[str, Any]:
    assert run["error"] is None, run["error"][-3000:]
    return run


def _weights_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return {k: tensor_rel(got[k], ref[k]) for k in ref}


@pytest.mark.parametrize("spec", STAGES)
@pytest.mark.parametrize("case", PARITY)
def test_trains_like_ddp(runs: Callable[[str, str], dict[str, Any]], case: str, spec: str) -> None:
    ref, got = _ok(runs(case, "ddp")), _ok(runs(case, spec))
    for rank, (r_got, r_ref) in enumerate(zip(got["per_rank"], ref["per_rank"])):
        assert len(r_ref["losses"]) >= 7 and len(r_got["losses"]) == len(r_ref["losses"]), (rank, len(r_got["losses"]))
        assert max_rel(r_got["losses"], r_ref["losses"]) < TOL, (rank, r_got["losses"], r_ref["losses"])
    bad = {k: v for k, v in _weights_rel(got["weights"], ref["weights"]).items() if not v < TOL}
    assert not bad, bad
    extra, ref_extra = got["per_rank"][0]["extra"], ref["per_rank"][0]["extra"]
    assert extra.get("global_step") == ref_extra.get("global_step")


def test_the_ddp_references_are_not_trivial(runs: Callable[[str, str], dict[str, Any]]) -> None:
    """Clipping changed the run (7 batches, windows of 3: 3 steps an epoch, the last on one batch);
    the frozen epoch left its layer alone; the accumulation scheduler changed the step count."""
    noclip = _ok(runs("noclip_acc3", "ddp"))
    assert noclip["per_rank"][0]["extra"]["global_step"] == 6
    for case in ("clip_norm_acc3", "clip_value_acc3"):
        clipped = _ok(runs(case, "ddp"))["weights"]
        assert max(_weights_rel(clipped, noclip["weights"]).values()) > 1e-2, case
    sched = _ok(runs("accumulation_scheduler", "ddp"))["per_rank"][0]["extra"]["global_step"]
    assert sched == 7 + 3 + 3, sched
    torch_clipped = _ok(runs("torch_clip", "ddp"))["weights"]
    module_clipped = _ok(runs("module_clip", "ddp"))
    assert max(_weights_rel(module_clipped["weights"], torch_clipped).values()) > 1e-2
    assert module_clipped["per_rank"][0]["extra"]["grads_present"] == 6  # the hook saw a .grad on each parameter
    # under ddp a torch clip after manual_backward is Lightning's clip: the route the refusal names
    manual = _weights_rel(_ok(runs("manual_torch_clip", "ddp"))["weights"], _ok(runs("manual_clip", "ddp"))["weights"])
    assert max(manual.values()) < TOL, manual
    ref = _ok(runs("freeze_then_unfreeze", "ddp"))
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ref["per_rank"])


def test_lr_find_and_best_checkpoint_match_ddp(runs: Callable[[str, str], dict[str, Any]]) -> None:
    """lr_find's curve and suggestion; the best checkpoint's name, validate/test on it, and the resumed fit."""
    ref = _ok(runs("lr_find", "ddp"))["per_rank"][0]["extra"]
    ckpt_ref = _ok(runs("ckpt_best", "ddp"))["per_rank"][0]["extra"]
    assert ckpt_ref["stopped_epoch"] < 5 and ckpt_ref["resumed_losses"]  # EarlyStopping stopped it
    for spec in STAGES:
        got = _ok(runs("lr_find", spec))["per_rank"][0]["extra"]
        assert got["lrs"] == ref["lrs"] and got["lr"] == ref["lr"], spec
        assert max_rel(got["lr_losses"], ref["lr_losses"]) < TOL, spec
        ckpt = _ok(runs("ckpt_best", spec))["per_rank"][0]["extra"]
        assert (ckpt["best"], ckpt["stopped_epoch"]) == (ckpt_ref["best"], ckpt_ref["stopped_epoch"]), spec
        for key in ("val_fit", "val_best", "test_best", "resumed_losses"):
            assert max_rel(ckpt[key], ckpt_ref[key]) < TOL, (spec, key)
        for key, metric in (("validate", "val_loss"), ("test", "test_loss")):
            assert abs(ckpt[key][0][metric] - ckpt_ref[key][0][metric]) < TOL * abs(ckpt_ref[key][0][metric]), spec
        bad = {k: v for k, v in _weights_rel(ckpt["resumed_weights"], ckpt_ref["resumed_weights"]).items() if not v < TOL}
        assert not bad, (spec, bad)


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_its_reason(runs: Callable[[str, str], dict[str, Any]], case: str) -> None:
    specs, says = REFUSED[case]
    for spec in specs:
        got = runs(case, spec)
        assert got["error"] is not None and says in got["error"], (spec, got["error"])
        assert got["error"].startswith("rank 0: ") and "\nrank 1: " in got["error"], got["error"][-2000:]  # both ranks
