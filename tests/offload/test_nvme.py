"""NVMe swapping: exact, checksummed swap files; corruption and deletion caught; the directory's life cycle."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.offload import nvme
from lightning_zero.offload.nvme import NvmeSwapper, SwapDir, SwapFileError, clean_stale
from lightning_zero.offload.pinned import aligned_empty
from tests.offload.helpers import fit

NVME = dict(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_chunk_mb=0.004)


# ---------------------------------------------------------------------------------------- the swapper
@pytest.fixture()
def swapper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NvmeSwapper:
    monkeypatch.setattr(nvme, "SEGMENT", 8192)  # several segments (and a partial tail) per file
    s = NvmeSwapper(SwapDir(tmp_path, rank=0), threads=3)
    yield s
    s.close()


@pytest.mark.parametrize("numel,dtype", [(1, torch.float32), (4097, torch.bfloat16), (10_001, torch.float32)])
def test_round_trip_and_exact_bytes(swapper: NvmeSwapper, numel: int, dtype: torch.dtype) -> None:
    src = aligned_empty(numel, dtype).copy_(torch.randn(numel))
    swapper.write("t", src).wait()
    path = swapper.dir.file("t")
    nbytes = numel * src.element_size()
    assert path.stat().st_size == nbytes  # exactly the tensor's bytes, no block padding
    assert path.read_bytes() == bytes(src.view(torch.uint8).numpy())
    dst = aligned_empty(numel, dtype)
    swapper.read("t", dst).wait()
    assert torch.equal(dst, src)


def test_corrupt_truncated_and_missing_files_are_caught(swapper: NvmeSwapper) -> None:
    src = aligned_empty(20_000, torch.float32).copy_(torch.randn(20_000))
    dst = aligned_empty(20_000, torch.float32)
    swapper.write("t", src).wait()
    path = swapper.dir.file("t")
    raw = bytearray(path.read_bytes())
    raw[50_000] ^= 0x01  # one flipped bit in the 7th 8 KiB segment
    path.write_bytes(bytes(raw))
    with pytest.raises(SwapFileError, match=r"corrupt: checksum mismatch in bytes \[49152, 57344\)"):
        swapper.read("t", dst).wait()
    path.write_bytes(bytes(raw[:1000]))
    with pytest.raises(SwapFileError, match="holds 1000 bytes, expected 80000"):
        swapper.read("t", dst).wait()
    path.unlink()
    with pytest.raises(SwapFileError, match="is missing"):
        swapper.read("t", dst).wait()


def test_buffered_fallback_where_direct_io_is_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open, as older tmpfs does) gets buffered I/O."""
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    d = SwapDir(tmp_path, rank=0)
    assert not d.direct
    s = NvmeSwapper(d, threads=1)
    src = aligned_empty(333, torch.float32).copy_(torch.arange(333.0))
    s.write("x", src).wait()
    out = aligned_empty(333, torch.float32)
    s.read("x", out).wait()
    assert torch.equal(out, src) and s.dir.file("x").stat().st_size == 333 * 4
    s.close()
    assert not d.path.exists()


def test_stale_directories_of_dead_runs_only(tmp_path: Path) -> None:
    root = tmp_path / nvme.ROOT_NAME
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    for name, owner in [("dead", {"host": host, "pid": dead.pid}), ("alive", {"host": host, "pid": os.getpid()}),
                        ("other_host", {"host": host + "-elsewhere", "pid": dead.pid})]:
        (root / name).mkdir(parents=True)
        (root / name / nvme.OWNER).write_text(json.dumps(owner))
        (root / name / "g0.c0.master.swap").write_bytes(b"x" * 10)
    (root / "not_ours").mkdir()
    (root / "not_ours" / "data.bin").write_bytes(b"keep")
    assert clean_stale(root) == [root / "dead"]
    assert sorted(p.name for p in root.iterdir()) == ["alive", "not_ours", "other_host"]


# ---------------------------------------------------------------------------------------- in training
class Snapshot(pl.Callback):
    """After step ``at``: raw swap-file bytes, then the same state read back through the engine."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.files: dict[str, bytes] = {}
        self.masters: list[torch.Tensor] = []
        self.states: list[dict[str, torch.Tensor]] = []
        self.records: dict[str, int] = {}
        self.chunks: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.at:
            return
        engine = trainer.strategy.engines[0]
        swap = Path(engine.swap_dir())
        self.files = {p.name[: -len(nvme.SUFFIX)]: p.read_bytes() for p in swap.glob("*" + nvme.SUFFIX)}
        self.records = {k: r.nbytes for k, r in engine._swapper.records.items()}
        self.chunks = engine._opt_store.chunks
        self.buckets = [[(b.shard_offset, b.chunk) for b in fg.layout.buckets] for fg in engine.groups]
        with engine.host_state():
            for fg in engine.groups:
                self.masters.append(fg.master.clone())
                st = trainer.optimizers[0].state[fg.master]
                self.states.append({k: st[k].clone() for k in ("exp_avg", "exp_avg_sq")})


class Reference(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at, self.masters = at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.masters = [fg.master.clone() for fg in trainer.strategy.engines[0].groups]


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def test_swap_files_hold_exactly_the_partitions(tmp_path: Path) -> None:
    snap, ref = Snapshot(at=3), Reference(at=3)
    fit(steps=4, callbacks=[snap], nvme_path=str(tmp_path), **NVME)
    fit(steps=4, callbacks=[ref], stage=3)
    assert snap.files and set(snap.files) == set(snap.records)  # every file is recorded, nothing else
    for gi, master in enumerate(snap.masters):
        torch.testing.assert_close(master, ref.masters[gi], rtol=1e-5, atol=1e-6)  # the right values ...
        for ci, (lo, hi) in enumerate(snap.chunks[gi]):  # ... and the files are exactly their bytes
            assert snap.files[f"g{gi}.c{ci}.master"] == _bytes(master[lo:hi])
            for key in ("exp_avg", "exp_avg_sq"):
                assert snap.files[f"g{gi}.c{ci}.{key}"] == _bytes(snap.states[gi][key][lo:hi])
        for bi, (off, n) in enumerate(snap.buckets[gi]):  # 32-true: the "16-bit" partition is the master
            assert snap.files[f"g{gi}.b{bi}.param16"] == _bytes(master[off : off + n])
    assert sum(len(c) for c in snap.chunks) > 4  # several chunks per group: the pipeline crossed boundaries


class Tamper(pl.Callback):
    def __init__(self, pattern: str, action: str) -> None:
        self.pattern, self.action, self.target = pattern, action, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        swap = Path(trainer.strategy.engines[0].swap_dir())
        self.target = sorted(swap.glob(self.pattern))[0]
        if self.action == "delete":
            self.target.unlink()
        else:
            raw = bytearray(self.target.read_bytes())
            raw[len(raw) // 2] ^= 0x40
            self.target.write_bytes(bytes(raw))


@pytest.mark.parametrize("pattern,action,message", [
    ("g0.c1.master.swap", "corrupt", "is corrupt: checksum mismatch"),  # read by the next optimizer step
    ("g0.c0.exp_avg_sq.swap", "delete", "is missing"),
    ("g0.b1.param16.swap", "corrupt", "is corrupt"),  # read by the next forward's gather
    ("g1.b0.param16.swap", "delete", "is missing"),
])
def test_tampered_swap_file_stops_training(tmp_path: Path, pattern: str, action: str, message: str) -> None:
    tamper = Tamper(pattern, action)
    with pytest.raises(SwapFileError, match=message) as err:
        fit(steps=6, callbacks=[tamper], nvme_path=str(tmp_path), **NVME)
    assert str(tamper.target) in str(err.value)
    left = [p.name for p in (tmp_path / nvme.ROOT_NAME).iterdir()]
    assert left == ["README.txt"]  # the failed run still removed its swap directory


def test_teardown_removes_files_and_next_start_cleans_stale(tmp_path: Path) -> None:
    root = tmp_path / nvme.ROOT_NAME
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = root / f"{socket.gethostname()}-pid{dead.pid}-rank0-deadbeef"
    stale.mkdir(parents=True)
    (stale / nvme.OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "rank": 0}))
    (stale / "g0.c0.master.swap").write_bytes(b"\0" * 4096)
    seen = Snapshot(at=1)
    trainer, model = fit(steps=2, callbacks=[seen], nvme_path=str(tmp_path), **NVME)
    assert not stale.exists()  # the crashed run's files went when this run started
    assert seen.files  # this run swapped ...
    assert sorted(p.name for p in root.iterdir()) == ["README.txt"]  # ... and cleaned up at teardown
    assert "NOT checkpoints" in (root / "README.txt").read_text()
    # after teardown the state lives in host memory: checkpoints and evaluation still work
    state = trainer.strategy.full_state_dict()
    assert set(state) == set(model.state_dict(keep_vars=True))  # names: stage 3 refuses the values (released_guard.py)
    assert trainer.validate(model, verbose=False)
