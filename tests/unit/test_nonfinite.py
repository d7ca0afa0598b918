"""Non-finite steps under Fabric (one process) and the pieces of a failed or refused checkpoint save
(issue #27 items 3-4; the 2-rank Trainer runs are tests/faults/test_nonfinite.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

import lightning_zero
from lightning_zero.checkpoint import atomic, save_errors
from lightning_zero.checkpoint.pieces import FlatPiece
from tests.fabric.fabric_worker import FabricNet


def _setup(**options: object) -> tuple[Fabric, torch.nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=lightning_zero.ZeroFabricStrategy(**options))
    fabric.launch()
    torch.manual_seed(0)
    model = FabricNet()
    opt = torch.optim.AdamW(model.param_groups(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    return fabric, model, opt


def _step(fabric: Fabric, model: torch.nn.Module, opt: torch.optim.Optimizer, nan: bool, clip: bool = False) -> None:
    loss = model(torch.arange(6).view(2, 3) % 7).float().pow(2).mean()
    fabric.backward(loss * float("nan") if nan else loss)
    if clip:
        fabric.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    opt.zero_grad()


def _masters(fabric: Fabric) -> list[torch.Tensor]:
    return [fg.master.detach().clone() for e in fabric.strategy.engines for fg in e.groups]


@pytest.mark.parametrize("stage", [1, 3])
def test_fabric_skips_a_nan_step_and_goes_on(stage: int, caplog: pytest.LogCaptureFixture) -> None:
    fabric, model, opt = _setup(stage=stage)
    _step(fabric, model, opt, nan=False)
    before = _masters(fabric)
    state = [v.clone() for st in opt.optimizer.state.values() for v in st.values()]
    with caplog.at_level("WARNING", logger="lightning_zero"):
        _step(fabric, model, opt, nan=True, clip=True)  # clip_gradients does not raise under 'skip'
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(fabric)))
    after = [v for st in opt.optimizer.state.values() for v in st.values()]
    assert len(after) == len(state) > 0 and all(torch.equal(a, b) for a, b in zip(state, after))
    assert fabric.strategy.skipped_steps == 1
    assert [r.getMessage() for r in caplog.records if "Non-finite" in r.getMessage()][0].count("at step 1") == 1
    _step(fabric, model, opt, nan=False)
    assert not all(torch.equal(a, b) for a, b in zip(before, _masters(fabric)))
    assert fabric.strategy.skipped_steps == 1


def test_fabric_error_and_ignore() -> None:
    fabric, model, opt = _setup(stage=2, nonfinite="error")
    with pytest.raises(lightning_zero.NonFiniteStepError, match=r"at step 0: first non-finite gradient in param group 0"):
        _step(fabric, model, opt, nan=True)
    fabric, model, opt = _setup(stage=2, nonfinite="ignore")
    _step(fabric, model, opt, nan=True)  # torch's behaviour: the step runs
    assert fabric.strategy.skipped_steps == 0
    assert not all(bool(torch.isfinite(m).all()) for m in _masters(fabric))


def test_first_nonfinite_names_the_first_entry_in_order() -> None:
    bad = torch.tensor([1.0, float("inf")])
    entries = {"a": torch.ones(3), "b": FlatPiece(torch.tensor([0.0, float("nan")]), 0, 2), "c": bad,
               "i": torch.arange(3), "s": "text"}
    assert save_errors.first_nonfinite(entries) == "b"
    assert save_errors.first_nonfinite({"a": torch.ones(3), "c": bad.bfloat16()}) == "c"
    assert save_errors.first_nonfinite({"a": torch.ones(3), "e": torch.empty(0)}) is None
    nested = save_errors.tensors_of({"state_dict": {"w": torch.ones(1)}, "optimizer_states": [{"state": {0: {"m": bad}}}]})
    assert save_errors.first_nonfinite(nested) == "optimizer_states.0.state.0.m"


def test_a_failed_save_is_one_line_naming_what_matters(tmp_path: Path) -> None:
    kept = tmp_path / "epoch=0.ckpt"
    kept.write_bytes(b"x")
    inner = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = RuntimeError("CheckpointException ranks:dict_keys([0, 1])\nTraceback ...")
    wrapped.failures = {1: (inner, None)}  # type: ignore[attr-defined]  # how DCP holds each rank's failure
    final = tmp_path / "epoch=1.ckpt"
    err = save_errors.save_failed(final, wrapped, 3_000_000, 1_000_000, save_errors.previous_checkpoint(final, None))
    msg = str(err)
    assert "\n" not in msg and err.errno == errno.ENOSPC and isinstance(err, OSError)
    for part in (str(final), "No space left on device (ENOSPC)", "on file system /", "needs 3.00 MB",
                 "1.00 MB were free", f"previous checkpoint {kept} is kept"):
        assert part in msg, (part, msg)
    ro = save_errors.save_failed(final, OSError(errno.EROFS, "Read-only file system"), 10, None, None)
    assert "Read-only file system (EROFS)" in str(ro) and "no earlier checkpoint exists there" in str(ro)


def test_commit_puts_the_old_checkpoint_back_when_the_rename_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final, partial = tmp_path / "last", tmp_path / ".lz-partial-x"
    final.mkdir()
    (final / "old").write_text("old")
    partial.mkdir()
    real = os.replace
    calls = {"n": 0}

    def failing_replace(a: object, b: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the partial's rename into place
            raise OSError(errno.EIO, "Input/output error")
        real(a, b)

    monkeypatch.setattr(atomic.os, "replace", failing_replace)
    with pytest.raises(OSError):
        atomic.commit(partial, final, fsync=False)
    assert (final / "old").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [".lz-partial-x", "last"]


def test_full_format_save_refuses_nan_and_survives_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fabric, model, opt = _setup(stage=2, checkpoint_format="full", nonfinite="ignore")
    _step(fabric, model, opt, nan=False)
    path = tmp_path / "last.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt})
    good = path.read_bytes()
    io = fabric.strategy.checkpoint_io
    real = io.save_checkpoint

    def full_disk(checkpoint: object, target: object, storage_options: object = None) -> None:
        Path(str(target)).write_bytes(b"half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io, "save_checkpoint", full_disk)
    with pytest.raises(save_errors.CheckpointSaveError) as err:
        fabric.save(path, {"model": model, "optimizer": opt})
    assert "\n" not in str(err.value) and "No space left on device (ENOSPC)" in str(err.value)
    assert f"previous checkpoint {path} is kept" in str(err.value)
    assert path.read_bytes() == good and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    monkeypatch.setattr(io, "save_checkpoint", real)
    _step(fabric, model, opt, nan=True)  # nonfinite='ignore': NaN weights from here on
    with pytest.raises(save_errors.NonFiniteCheckpointError, match=r"holds NaN or inf.*last.ckpt is kept"):
        fabric.save(path, {"model": model, "optimizer": opt})
    assert path.read_bytes() == good


def test_fp16_overflow_at_the_minimum_scale_follows_the_policy(caplog: pytest.LogCaptureFixture) -> None:
    """Above the minimum the scaler absorbs overflows as before; at it, NaN steps count as non-finite."""
    precision = lightning_zero.ZeroFabricPrecision("16-mixed", {"hysteresis": 1, "initial_scale_power": 1})
    fabric, model, opt = _setup(stage=2, precision=precision, max_nonfinite_steps=2)
    with caplog.at_level("WARNING", logger="lightning_zero"):
        _step(fabric, model, opt, nan=True)  # scale 2 -> 1: the scaler's skip
        assert fabric.strategy.loss_scale == 1.0 and fabric.strategy.skipped_steps == 1
        assert not [r for r in caplog.records if "Non-finite" in r.getMessage()]
        _step(fabric, model, opt, nan=True)  # at the minimum: the policy's first skip
        assert fabric.strategy.skipped_steps == 2
        assert [r for r in caplog.records if "Non-finite" in r.getMessage() and "at step 1" in r.getMessage()]
    with pytest.raises(lightning_zero.NonFiniteStepError, match=r"2 non-finite steps in a row"):
        _step(fabric, model, opt, nan=True)
