"""Offload settings that cannot work fail with one clear message before training starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_zero import ZeroStrategy
from lightning_zero.offload import engine as offload_engine, nvme
from lightning_zero.offload.nvme import NvmePathError
from tests.offload.helpers import fit
from tests.helpers.parity_model import ParityNet


@pytest.mark.parametrize("kwargs,message", [
    (dict(stage=2, offload_params="cpu", offload_optimizer="cpu"), r"offload_params='cpu' needs stage=3.*got stage=2"),
    (dict(stage=1, offload_params="nvme", offload_optimizer="nvme", nvme_path="/tmp"), "needs stage=3"),
    (dict(stage=3, offload_params="cpu"), "set offload_optimizer='cpu'"),
    (dict(stage=0, offload_optimizer="cpu"), "needs stage >= 1"),
    (dict(stage=3, offload_optimizer="nvme"), "needs nvme_path"),
    (dict(stage=2, offload_optimizer="gpu"), r"offload_optimizer must be one of \['none', 'cpu', 'nvme'\]"),
    (dict(stage=2, delayed_param_update=True), "delayed_param_update needs offload_optimizer"),
    (dict(stage=2, offload_optimizer="nvme", nvme_path="/tmp", nvme_chunk_mb=0), "nvme_chunk_mb must be > 0"),
])
def test_contradictory_settings_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


def _fit_fails(exc: type, message: str, **kwargs: object) -> None:
    model = ParityNet()
    with pytest.raises(exc, match=message):
        fit(steps=2, model=model, **kwargs)
    assert model.losses == []  # before the first training step


def test_missing_nvme_path(tmp_path: Path) -> None:
    _fit_fails(NvmePathError, "does not exist", stage=3, offload_optimizer="nvme", offload_params="nvme",
               nvme_path=str(tmp_path / "nope"))


def test_nvme_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    _fit_fails(NvmePathError, "is not a directory", stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path / "f"))


def test_read_only_nvme_path(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes through permission bits: use a read-only filesystem instead
        path = "/sys"
        if os.access("/sys", os.W_OK) and not _unwritable("/sys"):
            pytest.skip("no read-only directory available to root")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        path = str(ro)
    _fit_fails(NvmePathError, "is not writable", stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path=path)


def _unwritable(path: str) -> bool:
    try:
        with open(os.path.join(path, ".lz_probe"), "w"):
            pass
    except OSError:
        return True
    os.unlink(os.path.join(path, ".lz_probe"))
    return False


def test_too_small_nvme_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme, "free_disk_bytes", lambda path: 10_000)  # a 10 kB disk
    _fit_fails(NvmePathError, r"has 0.00 GiB free, but the swap files need .* GiB \(offload_optimizer='nvme'",
               stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    assert [p.name for p in (tmp_path / nvme.ROOT_NAME).iterdir()] == []  # nothing written


@pytest.mark.parametrize("setting,advice", [
    (dict(stage=2, offload_optimizer="cpu"), "Set offload_optimizer='nvme'"),
    (dict(stage=3, offload_optimizer="cpu", offload_params="cpu"), "pin_memory=False"),
])
def test_not_enough_host_memory(monkeypatch: pytest.MonkeyPatch, setting: dict, advice: str) -> None:
    monkeypatch.setattr(offload_engine, "available_host_bytes", lambda: 50_000)  # 50 kB free
    _fit_fails(MemoryError, rf"Offload needs .* GiB of host memory .*offload_optimizer='cpu'.*{advice}", **setting)


def test_delayed_update_needs_adam() -> None:
    model = ParityNet(optimizer="sgd")
    with pytest.raises(ValueError, match="delayed_param_update needs torch.optim.Adam/AdamW"):
        fit(steps=2, model=model, stage=2, offload_optimizer="cpu", delayed_param_update=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_host_memory_check_counts_the_accumulator(monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    """With accumulate_grad_batches > 1 the fp32 accumulator (4 bytes per partitioned parameter,
    allocated at the second micro-batch) is in the host-memory check before anything is allocated."""
    needs: list[int] = []
    monkeypatch.setattr(offload_engine, "check_host_memory", lambda need, *a, **k: needs.append(need))
    extra = dict(offload_params="cpu") if stage == 3 else {}
    for accumulate in (1, 2):
        fit(steps=2, accumulate=accumulate, stage=stage, offload_optimizer="cpu", **extra)
    trainable = sum(p.numel() for p in ParityNet().parameters() if p.requires_grad)
    assert len(needs) == 2 and needs[1] - needs[0] >= 4 * trainable * 0.99, (needs, trainable)
