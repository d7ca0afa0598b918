"""Resuming a sharded checkpoint under another stage, offload setting and world size (issue #13).

The reference: CkptNet, 2 ranks, zero3, 6 steps on one fixed global batch per step, ModelCheckpoint
every 3 steps. Its step-3 directory is resumed on 3 ranks zero2, 1 process zero1, 2 ranks Lightning
``ddp`` (through ``consolidate``) and 4 ranks zero3_offload. Each resumed run, right after the restore
(``on_train_start``), records its full weights (``full_state_dict()``; ddp: the module's) and saves a
checkpoint again, the state as loaded (ddp: records its optimizer and scheduler state directly). Then:

* the weights equal the reference's ``full_state_dict()`` at the save, bit for bit;
* the Adam state (consolidated re-save, or ddp's own) equals the consolidated original bit for bit;
* the global losses of steps 3-5 are within 1e-4 of the uninterrupted reference.

The same for ``checkpoint_async=True`` (its checkpoints must equal the synchronous run's exactly) and
for a GAN (two optimizers, a frozen layer) written under zero3 on 2 ranks, resumed under zero2 on 3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.common import (
    assert_complete_sharded, assert_losses_close, assert_same, assert_same_optimizer, assert_same_weights,
    global_losses, load, partials,
)
from tests.checkpoint.conftest import GAN_SAVE, SAVE_EVERY, STEP3, STEP6, STEPS
from tests.checkpoint.models import TinyGAN

RESUMES = {  # name -> (fixture, world size)
    "z3_to_z2": ("three_ranks", 3),
    "z3_to_z1": ("one_rank", 1),
    "ddp_resume": ("written", 2),
    "z3_to_z3off": ("four_ranks", 4),
}


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory):
    """consolidated(path) -> the loaded consolidated checkpoint of a sharded directory (cached)."""
    from lightning_zero.checkpoint import consolidate

    out = tmp_path_factory.mktemp("resume_full")
    cache: dict[str, dict] = {}

    def get(path: Path) -> dict:
        key = str(path)
        if key not in cache:
            assert Path(path).is_dir(), f"no sharded checkpoint at {path}"
            dst = out / f"{len(cache)}.ckpt"
            consolidate(key, str(dst))
            cache[key] = load(dst)
        return cache[key]

    return get


def _launch(request, fixture: str):
    value = request.getfixturevalue(fixture)
    return value[0] if isinstance(value, tuple) else value


def _reference(written) -> tuple[list[dict], dict]:
    run, _ = written
    ranks = run.ok("z3")
    return ranks, global_losses(ranks)


def _check_resume(ranks: list[dict], world: int, saved: dict, orig: dict, ref_losses: dict, consolidated,
                  resave: Path | None, ddp: bool = False, loss_keys: tuple[str, ...] = ("losses",),
                  first: int = SAVE_EVERY, start_step: int = SAVE_EVERY, ref_by_key: dict | None = None) -> None:
    assert len(ranks) == world and all(r["world"] == world for r in ranks)
    assert all(r["start_step"] == start_step for r in ranks), [r["start_step"] for r in ranks]
    assert_same_weights(ranks[0]["start_state"], saved, "weights after the restore")
    if ddp:
        got_opts, got_scheds = ranks[0]["start_optim"], ranks[0]["start_sched"]
    else:
        assert resave is not None
        again = consolidated(resave)
        got_opts, got_scheds = again["optimizer_states"], [s for s in again.get("lr_schedulers", [])]
        assert_same_weights(again["state_dict"], orig["state_dict"], "re-saved weights")
    assert len(got_opts) == len(orig["optimizer_states"])
    for i, (got, ref) in enumerate(zip(got_opts, orig["optimizer_states"])):
        assert_same_optimizer(got, ref, f"optimizer {i}")
    assert_same(list(got_scheds), list(orig.get("lr_schedulers", [])), "lr_schedulers")
    for key in loss_keys:
        ref = (ref_by_key or {}).get(key, ref_losses)
        last = max(ref)
        assert_losses_close(global_losses(ranks, key), ref, list(range(first, last + 1)))


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_under_another_stage_and_world_size(request, written, consolidated, name: str) -> None:
    fixture, world = RESUMES[name]
    launch = _launch(request, fixture)
    ranks = launch.ok(name)
    ref_ranks, ref_losses = _reference(written)
    assert sorted(ref_losses) == list(range(STEPS))
    _, paths = written
    orig = consolidated(paths.z3_step3)
    saved = ref_ranks[0]["captured"][SAVE_EVERY]
    resave = launch.tmp / "resave" / f"{name}.ckpt"
    _check_resume(ranks, world, saved, orig, ref_losses, consolidated, resave, ddp=name == "ddp_resume")


def test_async_checkpoints_complete_and_equal_the_synchronous_ones(written, consolidated) -> None:
    run, paths = written
    sync, asyn = run.ok("z3"), run.ok("z3_async")
    assert global_losses(asyn) == global_losses(sync)  # saving in the background changed nothing
    for step in (STEP3, STEP6):
        assert_complete_sharded(paths.z3_async / step)
        a, s = consolidated(paths.z3_async / step), consolidated(paths.z3 / step)
        assert_same_weights(a["state_dict"], s["state_dict"], step)
        for got, ref in zip(a["optimizer_states"], s["optimizer_states"]):
            assert_same_optimizer(got, ref, step)
        assert a["global_step"] == s["global_step"]
    assert sorted(p.name for p in paths.z3_async.iterdir()) == [STEP3, STEP6]
    assert not partials(paths.z3_async)


def test_async_checkpoint_resumes_exactly(written, consolidated) -> None:
    run, paths = written
    ranks = run.ok("z3_async_resume")
    ref_ranks, ref_losses = _reference(written)
    resave = paths.out / "resave" / "z3_async_resume.ckpt"
    _check_resume(ranks, 2, ref_ranks[0]["captured"][SAVE_EVERY], consolidated(paths.z3_step3), ref_losses,
                  consolidated, resave)


def test_gan_with_frozen_layer_and_two_optimizers_round_trips(written, three_ranks, consolidated) -> None:
    run, paths = written
    writer = run.ok("gan_z3")
    ranks = three_ranks.ok("gan_to_z2")
    saved = writer[0]["captured"][GAN_SAVE]
    frozen = [k for k in saved if k.startswith(TinyGAN.FROZEN)]
    assert frozen and all(saved[k].abs().sum() > 0 for k in frozen)  # the frozen layer is in the checkpoint
    orig = consolidated(paths.gan)
    assert len(orig["optimizer_states"]) == 2
    assert_same_weights(orig["state_dict"], saved, "consolidated GAN")
    refs = {k: global_losses(writer, k) for k in ("g_losses", "d_losses")}
    _check_resume(ranks, 3, saved, orig, {}, consolidated, three_ranks.tmp / "resave" / "gan_to_z2.ckpt",
                  loss_keys=("g_losses", "d_losses"), first=GAN_SAVE // 2, start_step=GAN_SAVE, ref_by_key=refs)
