"""Consolidation and direct loading of a sharded checkpoint (issue #13).

The reference run (2 ranks, zero3) recorded ``strategy.full_state_dict()`` right before
ModelCheckpoint wrote ``epoch=0-step=3.ckpt/``; its ranks consolidated that directory with
``lightning_zero.checkpoint.consolidate``. Checked here: the consolidated file holds exactly those
weights (and ``load_from_checkpoint`` reproduces them), torch-format Adam state a plain optimizer
loads, Lightning's bookkeeping; the CLI's ``consolidate`` writes the same, ``--safetensors`` exports
the weights exactly, ``inspect`` reports step and world size; ``load_from_checkpoint(DIR)`` works.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoint.common import assert_same, assert_same_optimizer, assert_same_weights, load
from tests.checkpoint.conftest import SAVE_EVERY
from tests.checkpoint.launch import clean_env
from tests.checkpoint.models import CkptNet
from tests.helpers.launch import ROOT
from tests.helpers.side_by_side import SideBySide


@pytest.fixture(scope="module")
def reference(written) -> tuple[dict, dict]:
    """(full weights at the step-3 save, the consolidated step-3 checkpoint)."""
    run, paths = written
    saved = run.ok("z3")[0]["captured"][SAVE_EVERY]
    run.ok("consolidate_z3")
    assert paths.z3_full.is_file(), paths.z3_full
    return saved, load(paths.z3_full)


@pytest.fixture(scope="module")
def cli(written, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SideBySide, Path]]:
    """The three CLI runs on the step-3 checkpoint, started at once (tests/helpers/side_by_side.py [Note: side
    by side]), and their output folder."""
    _, paths = written
    tmp = tmp_path_factory.mktemp("ckpt_cli")
    cmd = [sys.executable, "-m", "lightning_zero.checkpoint"]
    runs = SideBySide({
        "consolidate": [*cmd, "consolidate", str(paths.z3_step3), str(tmp / "cli.ckpt")],
        "safetensors": [*cmd, "consolidate", str(paths.z3_step3), str(tmp / "weights.safetensors"), "--safetensors"],
        "inspect": [*cmd, "inspect", str(paths.z3_step3)],
    }, cwd=ROOT, env=clean_env(), timeout=120)
    try:
        yield runs, tmp
    finally:
        runs.close()


def test_consolidated_file_is_an_ordinary_lightning_checkpoint(reference) -> None:
    saved, ckpt = reference
    assert_same_weights(ckpt["state_dict"], saved, "state_dict")
    assert ckpt["global_step"] == SAVE_EVERY
    assert "loops" in ckpt and "lr_schedulers" in ckpt and "epoch" in ckpt
    assert ckpt["hyper_parameters"]["lr"] == CkptNet().hparams.lr
    assert len(ckpt["optimizer_states"]) == 1
    # torch's per-parameter format: a plain AdamW on the plain module takes it as it is
    model = CkptNet()
    model.load_state_dict(ckpt["state_dict"])
    opt = model.configure_optimizers()["optimizer"]
    opt.load_state_dict(ckpt["optimizer_states"][0])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(ckpt["optimizer_states"][0]["state"]) == len(trainable)
    for p in trainable:
        st = opt.state[p]
        assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape
        assert float(st["step"]) == SAVE_EVERY
        assert float(st["exp_avg_sq"].abs().sum()) > 0


def test_load_from_checkpoint_reproduces_the_full_weights(written, reference) -> None:
    _, paths = written
    saved, _ = reference
    model = CkptNet.load_from_checkpoint(str(paths.z3_full), map_location="cpu")
    assert_same_weights(model.state_dict(), saved)


def test_load_from_checkpoint_reads_the_sharded_directory(written, reference) -> None:
    import lightning_zero  # noqa: F401  (registers the sharded-directory loader)

    _, paths = written
    saved, _ = reference
    model = CkptNet.load_from_checkpoint(str(paths.z3_step3), map_location="cpu")
    assert_same_weights(model.state_dict(), saved)


def test_is_sharded_checkpoint(written) -> None:
    from lightning_zero.checkpoint import is_sharded_checkpoint

    _, paths = written
    assert is_sharded_checkpoint(str(paths.z3_step3))
    assert not is_sharded_checkpoint(str(paths.z3_full))


def test_cli_consolidate_writes_the_same_checkpoint(cli, reference) -> None:
    runs, tmp = cli
    _, ckpt = reference
    out = tmp / "cli.ckpt"
    proc = runs.get("consolidate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = load(out)
    assert_same_weights(got["state_dict"], ckpt["state_dict"])
    assert_same_optimizer(got["optimizer_states"][0], ckpt["optimizer_states"][0])
    assert got["global_step"] == ckpt["global_step"]
    assert_same(got["lr_schedulers"], ckpt["lr_schedulers"])


def test_safetensors_export_round_trips(cli, reference) -> None:
    from safetensors.torch import load_file

    runs, tmp = cli
    saved, _ = reference
    out = tmp / "weights.safetensors"
    proc = runs.get("safetensors")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_same_weights(load_file(str(out)), saved)
    model = CkptNet()
    model.load_state_dict(load_file(str(out)))  # the module's own names, nothing else
    assert_same_weights(model.state_dict(), saved)


def test_inspect_reports_step_and_world_size(cli) -> None:
    proc = cli[0].get("inspect")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert re.search(rf"step\D{{0,30}}\b{SAVE_EVERY}\b", text, re.IGNORECASE), text
    assert re.search(r"world[ _-]?size\D{0,30}\b2\b", text, re.IGNORECASE), text
    assert re.search(r"stage\D{0,30}\b3\b", text, re.IGNORECASE), text
    assert re.search(r"tensors?", text, re.IGNORECASE) and re.search(r"bytes|[KMG]i?B\b", text), text
