"""The user's own torch optimizer, param groups and LR scheduler under every ZeRO stage, against Lightning's ddp
(one launch of scenario ``user_optim.parity``, runs.py).

The engines step flat fp32 shards in place of the user's parameters (zero/flat_group.py [Note: parameters are
views]); what must hold is that nothing the user brings trains differently from ddp with the same optimizer:
options of the optimizer (amsgrad, maximize, nesterov, centered RMSprop, Adagrad), nanoGPT's decay/no-decay groups
with their own lr/betas/eps/momentum, schedulers that edit ``betas``/``momentum`` every step (OneCycleLR,
CyclicLR), one LambdaLR per group, parameters that get no gradient on some steps (on every rank, or on one rank
only) and a resume from a checkpoint (ours, sharded or full, or ddp's) taken while a parameter lagged its
group's step count or had never been stepped (zero/state_dict.py [Note: per-parameter step counts in
checkpoints]: without it the resumed runs missed ddp's by 3e-3 in the loss), and ``zero_grad(set_to_none=False)``,
under which torch steps every parameter used once with zero gradients ever after (zero/unused.py [Note:
zero_grad(set_to_none=False)]: without it the losses missed ddp's by 0.13 with AdamW, 0.41 with SGD), and the
Lightning hooks users override around the step (``optimizer_step`` setting each group's lr, Lightning's warm-up
recipe; ``optimizer_step`` skipping every other step while still running the closure; a timm-style scheduler
stepped by ``lr_scheduler_step``). What cannot step a subset of a flat group is refused with one sentence. A
unit skipped on one rank under ZeRO-3 is tests/distributed/test_skipped_units.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_scenario

ALL = ["zero1", "zero2", "zero3", "zero3_offload"]
CASES: dict[str, dict] = {
    "onecycle_adamw": {"opt": "adamw", "sched": "onecycle", "skip": True},
    "cyclic_sgd_nesterov": {"opt": "sgd_nesterov", "sched": "cyclic", "skip": True},
    "cyclic_rmsprop_centered": {"opt": "rmsprop_centered", "sched": "cyclic"},
    "lambda_amsgrad_maximize": {"opt": "adamw_amsgrad_maximize", "sched": "lambda", "skip": True},
    "adagrad": {"opt": "adagrad", "skip": True},
    "rank_skip_sgd": {"opt": "sgd", "skip": True, "rank_skip": True, "kinds": ["ddp", "zero1", "zero2"]},
    "resume_adamw": {"opt": "adamw", "skip": True, "late": True, "resume": True},
    "resume_adamw_full": {"opt": "adamw", "skip": True, "late": True, "resume": True, "ckpt": "full",
                          "kinds": ["ddp", "zero2"]},
    "resume_from_ddp": {"opt": "adamw", "skip": True, "late": True, "resume": True, "ckpt": "full", "first": "ddp",
                        "kinds": ["ddp", "zero1", "zero3_offload"]},
    "zero_grad_keep_sgd": {"opt": "sgd", "skip": True, "keep_grads": True},
    "zero_grad_keep_resume": {"opt": "adamw", "skip": True, "late": True, "keep_grads": True, "resume": True},
    "onecycle_adam_decoupled": {"opt": "adam_decoupled", "sched": "onecycle", "skip": True},
    "nadam_skip": {"opt": "nadam_decoupled", "skip": True, "steps": 2},
    "sgd_dampening_skip": {"opt": "sgd_dampening", "skip": True, "steps": 2},
    # Lightning hooks overridden as Lightning's docs and timm show (runs.py HOOKS)
    "warmup_hook_adamw": {"opt": "adamw", "hook": "warmup"},
    "every_other_step_sgd": {"opt": "sgd", "hook": "every_other"},
    "every_other_step_adamw": {"opt": "adamw", "hook": "every_other", "skip": True},
    "timm_scheduler_adamw": {"opt": "adamw", "sched": "timm", "hook": "timm"},
}
REFUSED = {"nadam_skip": "NAdam keeps a per-tensor state 'mu_product': it cannot step a subset of a flat group",
           "sgd_dampening_skip": "SGD with momentum and dampening starts a parameter's momentum from its first"}
STEPS = 8


def _kinds(case: str) -> list[str]:
    return [k for k in CASES[case].get("kinds", ["ddp", *ALL]) if k != "ddp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("user_optim")
    cases = {name: {"steps": STEPS, **c} for name, c in CASES.items()}
    run_scenario("user_optim.parity", nprocs=2, timeout=900, out=out, env={"CUDA_VISIBLE_DEVICES": ""},
                 params={"cases": cases, "kinds": ["ddp", *ALL]}).check()
    return {p.stem: torch.load(p, weights_only=False) for p in Path(out).glob("*.pt")}


@pytest.mark.parametrize(("case", "kind"), [(c, k) for c in CASES if c not in REFUSED for k in _kinds(c)])
def test_trains_like_ddp(runs: dict[str, dict], case: str, kind: str) -> None:
    ref, got = runs[f"{case}__ddp"], runs[f"{case}__{kind}"]
    assert ref["error"] == "" and got["error"] == ""
    assert len(ref["losses"]) == len(got["losses"]) >= STEPS  # every_other: two batches a step
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-6)
    assert got["lrs"] == pytest.approx(ref["lrs"], rel=1e-6)
    assert set(got["weights"]) == set(ref["weights"])
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("case", "kind"), [(c, k) for c in REFUSED for k in _kinds(c)])
def test_refuses_what_it_cannot_match(runs: dict[str, dict], case: str, kind: str) -> None:
    assert runs[f"{case}__ddp"]["error"] == ""
    assert REFUSED[case] in runs[f"{case}__{kind}"]["error"]
