"""kill -9 of a rank while it writes a checkpoint (issue #13).

The reference run again (2 ranks, zero3, ModelCheckpoint every 3 steps, ``save_last=True``); rank 1
SIGKILLs itself while writing the step-6 checkpoint, right after the first tensor of its shard went into
a file. torchrun must tear the job down; the directory must hold the complete step-3 checkpoint and
``last.ckpt`` and an unfinished ``.lz-partial-*`` (never a ``epoch=0-step=6.ckpt``); a fresh run with
``ckpt_path="last"`` (3 ranks, zero2) must resume at step 3 with the reference's step-3 weights exactly
and continue its losses.
"""

from __future__ import annotations

import re

from tests.checkpoint.common import assert_complete_sharded, assert_losses_close, assert_same_weights, global_losses
from tests.checkpoint.conftest import SAVE_EVERY, STEP3, STEP6, STEPS


def test_torchrun_tears_the_job_down(killed) -> None:
    run, ckpts, _ = killed
    assert not run.timed_out, run.log[-6000:]
    assert run.returncode != 0, run.log[-6000:]
    assert re.search(r"SIGKILL|exitcode\s*:\s*-9|Signal 9", run.log), run.log[-6000:]
    marker = run.tmp / "kill_marker"
    assert marker.exists(), "rank 1 never reached a shard write during the step-6 save:\n" + run.log[-6000:]
    text = marker.read_text()
    # it was writing its own shard, under the temporary name
    assert re.search(r"shard files open: \[.*\.lz-partial[^/]*/__1_\d+\.distcp", text), text
    rank0 = run.results["kill"][0]
    assert rank0 is None or rank0["error"], "rank 0 finished although rank 1 died"


def test_previous_checkpoint_intact_and_partial_left_aside(killed) -> None:
    run, ckpts, listing = killed
    assert STEP3 in listing and "last.ckpt" in listing, listing
    assert STEP6 not in listing, listing
    assert any(n.startswith(".lz-partial") for n in listing), listing
    assert not [n for n in listing if n not in (STEP3, "last.ckpt") and not n.startswith(".lz-partial")], listing
    assert_complete_sharded(ckpts / STEP3)
    from lightning_zero.checkpoint import is_sharded_checkpoint

    assert is_sharded_checkpoint(str(ckpts / "last.ckpt"))


def test_fresh_run_resumes_from_the_last_complete_checkpoint(killed, three_ranks, written) -> None:
    ranks = three_ranks.ok("kill_resume")
    assert all(r["start_step"] == SAVE_EVERY for r in ranks), [r["start_step"] for r in ranks]
    wrun, _ = written
    ref = wrun.ok("z3")
    # the killed run trained exactly like the reference up to its step-3 save (same seed, data, ranks)
    assert_same_weights(ranks[0]["start_state"], ref[0]["captured"][SAVE_EVERY])
    assert_losses_close(global_losses(ranks), global_losses(ref), list(range(SAVE_EVERY, STEPS)))
    _, ckpts, _ = killed
    assert_complete_sharded(ckpts / STEP6)  # and it saved the step it had lost
