"""Async-save staging (lightning_zero/checkpoint/async_stage.py [Note: async staging]).

On CPU: the staged copy is the state at the save whatever happens to the tensors afterwards, and the
non-finite refusal still stops the write (now from the writer thread). On CUDA (gpu-marked, the lent
machine): a checkpoint saved asynchronously while training goes on equals a synchronous one, for the
device snapshot and for the in-place copy, with the side stream held back ~100 ms so that a missing
fence would let the next optimizer step change the states under the copy; and with the fence disabled
the in-place copy does differ (so the check above can fail)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero.checkpoint import async_stage
from lightning_zero.checkpoint.async_stage import Stager
from lightning_zero.checkpoint.consolidate import load_consolidated
from lightning_zero.checkpoint.pieces import FlatPiece
from lightning_zero.checkpoint.save_errors import NonFiniteCheckpointError
from lightning_zero.checkpoint.sharded import ShardedCheckpointer
from tests.checkpoint.common import assert_same_optimizer, assert_same_weights


def _piece(t: torch.Tensor) -> FlatPiece:
    from lightning_zero.checkpoint import layout as L

    return L.make_piece(t.view(-1), 0, L.tensor_block(t))


def test_staged_copies_are_the_state_at_the_save() -> None:
    master = torch.arange(10, dtype=torch.float32)
    step = torch.tensor(3.0)
    entries: dict[str, Any] = {"w": _piece(master), "step": step, "hyper": {"lr": 0.1}}
    staged = Stager().stage(entries, step_only={master.untyped_storage().data_ptr()})
    master.add_(100.0)  # what the next optimizer step would do
    step.add_(1.0)
    entries["hyper"]["lr"] = 0.5
    assert staged.finish() is None
    assert staged.where == "host"
    assert torch.equal(staged.entries["w"].source, torch.arange(10, dtype=torch.float32))
    assert staged.entries["w"].source.data_ptr() != master.data_ptr()
    assert float(staged.entries["step"]) == 3.0
    assert staged.entries["hyper"] == {"lr": 0.1}


def test_finish_names_the_first_non_finite_entry_in_order() -> None:
    a, b, c = torch.ones(4), torch.ones(4), torch.ones(4)
    b[1], c[0] = math.nan, math.inf
    staged = Stager().stage({"a": a, "b": _piece(b), "c": c}, step_only=set())
    assert staged.finish() == "b"
    staged = Stager().stage({"a": a, "i": torch.arange(3)}, step_only=set())
    assert staged.finish() is None


def test_the_arena_is_reused_by_the_next_save() -> None:
    stager = Stager()
    x = torch.ones(1000)
    first = stager.stage({"x": x}, step_only=set())
    buffer = stager.arena.buffer
    assert first.finish() is None and torch.equal(first.entries["x"], torch.ones(1000))
    second = stager.stage({"x": x * 2}, step_only=set())
    assert stager.arena.buffer is buffer  # reused: the checkpointer waits for the first save before staging again
    assert second.finish() is None and torch.equal(second.entries["x"], torch.full((1000,), 2.0))


def test_pieces_of_one_flat_buffer_are_copied_as_one_range_and_come_back_as_their_own_views() -> None:
    flat = torch.arange(100, dtype=torch.float32)
    state = torch.arange(100, dtype=torch.float32) * -1
    other = torch.arange(6, dtype=torch.float32).view(2, 3).t()  # non-contiguous
    entries = {"a": _piece(flat[0:40]), "b": _piece(flat[40:90]), "m": _piece(state[10:60]), "o": other,
               "far": _piece(torch.arange(10_000, dtype=torch.float32)[9_990:])}  # a sparse view: its own region
    staged = Stager().stage(entries, step_only=set())
    assert len(staged.regions) == 4  # flat, state, other, far
    flat.zero_(), state.zero_()
    assert staged.finish() is None
    assert torch.equal(staged.entries["a"].source, torch.arange(40, dtype=torch.float32))
    assert torch.equal(staged.entries["b"].source, torch.arange(40, 90, dtype=torch.float32))
    assert torch.equal(staged.entries["m"].source, -torch.arange(10, 60, dtype=torch.float32))
    assert torch.equal(staged.entries["o"], torch.arange(6, dtype=torch.float32).view(2, 3).t())
    assert torch.equal(staged.entries["far"].source, torch.arange(9_990, 10_000, dtype=torch.float32))
    assert staged.entries["a"].start == entries["a"].start and staged.entries["a"].block == entries["a"].block


def test_an_async_save_of_a_nan_refuses_to_write_and_says_so_at_wait(tmp_path: Path) -> None:
    """The refusal runs in the writer thread now (the caller is not held for the scan): nothing written,
    the error raised where async errors surface, the next save or the end of fit."""
    saver = ShardedCheckpointer(group=None, async_save=True)
    entries = {"state_dict.w": torch.tensor([1.0, math.nan])}
    staged = saver._stager.stage(entries, step_only=set())
    saver._pending = async_stage_thread(saver, staged, tmp_path / "ckpt")
    with pytest.raises(NonFiniteCheckpointError, match="state_dict.w"):
        saver.wait()
    assert not (tmp_path / "ckpt").exists()


def async_stage_thread(saver: ShardedCheckpointer, staged: Any, final: Path) -> Any:
    from lightning_zero.checkpoint.sharded import _in_daemon_thread

    return _in_daemon_thread(saver._write_staged, staged, b"", final)


# ---------------------------------------------------------------------------------------------- CUDA
SAVE_AT = (2, 4)
SLEEP_CYCLES = 200_000_000  # ~100 ms at H100/H200 clocks: far longer than one step of this model


class _Net(pl.LightningModule):
    """Linear, BatchNorm (a buffer the forward changes), Linear; Adam; fixed data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8))
        g = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 8, generator=g))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=32)


class _SaveAt(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step in SAVE_AT:
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}")


def _train(out: Path, stage: int, asynchronous: bool) -> Path:
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_SaveAt(out)],
        strategy=lightning_zero.ZeroStrategy(stage=stage, checkpoint_async=asynchronous),
    )
    trainer.fit(_Net())
    return out


def _slow_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Stager._side

    def slow(self: Stager, device: torch.device) -> Any:
        side = original(self, device)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
        return side

    monkeypatch.setattr(Stager, "_side", slow)


def _equal(a: Path, b: Path) -> None:
    for s in SAVE_AT:
        got, ref = load_consolidated(a / f"step{s}"), load_consolidated(b / f"step{s}")
        assert_same_weights(got["state_dict"], ref["state_dict"], f"step {s}")
        for g, r in zip(got["optimizer_states"], ref["optimizer_states"]):
            assert_same_optimizer(g, r, f"step {s}")


def _differs(a: Path, b: Path) -> bool:
    try:
        _equal(a, b)
    except AssertionError:
        return True
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("where", ["device snapshot", "in place"])
def test_async_saves_while_training_equal_synchronous_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           stage: int, where: str) -> None:
    ref = _train(tmp_path / "sync", stage, asynchronous=False)
    _slow_side_stream(monkeypatch)
    monkeypatch.setattr(async_stage, "device_room", lambda device, need: where == "device snapshot")
    monkeypatch.setattr(async_stage, "D2H_CHUNK_BYTES", 1000)  # a snapshot's copies in many odd-sized pieces
    seen: list[str] = []
    original = Stager.stage

    def recording(self: Stager, entries: Any, step_only: Any) -> Any:
        staged = original(self, entries, step_only)
        seen.append(staged.where)
        return staged

    monkeypatch.setattr(Stager, "stage", recording)
    got = _train(tmp_path / "async", stage, asynchronous=True)
    assert seen == [where] * len(SAVE_AT)
    _equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_without_the_fence_the_in_place_copy_races_the_next_step(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the step's wait removed, the held-back copy reads states the next
    optimizer step already changed."""
    ref = _train(tmp_path / "sync", 1, asynchronous=False)
    _slow_side_stream(monkeypatch)
    monkeypatch.setattr(async_stage, "device_room", lambda device, need: False)
    monkeypatch.setattr(Stager, "fence", lambda self: None)
    got = _train(tmp_path / "async", 1, asynchronous=True)
    assert _differs(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_copies_land_every_byte() -> None:
    """copy_in_chunks against a whole copy: pieces that do not divide the chunk, several dtypes, one
    non-contiguous pair (copied whole)."""
    torch.manual_seed(0)
    sources = [torch.randn(1237, device="cuda"), torch.randn(33, 17, device="cuda").to(torch.bfloat16),
               torch.randint(0, 255, (5001,), dtype=torch.uint8, device="cuda"),
               torch.randn(64, 48, device="cuda").t()]
    hosts = [torch.zeros(s.shape, dtype=s.dtype, pin_memory=True) for s in sources]
    hosts[-1] = hosts[-1].t().contiguous().t()  # the non-contiguous pair's host view has its layout
    async_stage.copy_in_chunks(list(zip(sources, hosts)), torch.cuda.Stream(), 1000)
    for s, h in zip(sources, hosts):
        assert torch.equal(h, s.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_chunked_copies_from_a_fresh_thread_of_another_device() -> None:
    """The writer thread issues a snapshot's copies; a fresh thread's current device is 0, the pieces may be
    on another (rank 1 of a node)."""
    import threading

    src = torch.randn(100_003, device="cuda:1")
    dst = torch.zeros(src.shape, pin_memory=True)
    side = torch.cuda.Stream(torch.device("cuda:1"))
    errors: list[BaseException] = []

    def job() -> None:
        try:
            async_stage.copy_in_chunks([(src, dst)], side, 4096)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert not errors and torch.equal(dst, src.cpu())
