"""The example corpus: real text of useful length, deterministic next-token windows, clean split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import TextDataModule, WindowDataset, load_corpus, tokenize  # noqa: E402


def test_pydoc_corpus_is_real_text_of_useful_length() -> None:
    text = load_corpus("pydoc")
    assert len(text) > 300_000  # ~450 KB on CPython 3.11
    tokens = tokenize(text)
    assert tokens.dtype == torch.long and 0 <= int(tokens.min()) and int(tokens.max()) < 256
    assert b"statement" in text and b"Assert statements" in text  # English prose about Python
    printable = sum(32 <= b < 127 or b in (9, 10) for b in text[:10_000])
    assert printable / 10_000 > 0.95
    assert load_corpus("pydoc") == text  # same order every time


def test_windows_are_shifted_pairs_at_fixed_stride() -> None:
    tokens = torch.arange(100)
    ds = WindowDataset(tokens, seq_len=8, stride=5)
    assert len(ds) == (100 - 9) // 5 + 1
    for i in (0, 3, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (8,)
        assert torch.equal(x, tokens[5 * i : 5 * i + 8])
        assert torch.equal(y, tokens[5 * i + 1 : 5 * i + 9])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="too short"):
        WindowDataset(torch.arange(5), seq_len=8, stride=8)


def test_datamodule_is_deterministic_and_splits_by_position() -> None:
    a, b = TextDataModule(seq_len=32, batch_size=4), TextDataModule(seq_len=32, batch_size=4)
    for dm in (a, b):
        dm.setup("fit")
    assert a.train_set is not None and a.val_set is not None and b.train_set is not None
    assert len(a.train_set) == len(b.train_set) > 1000
    for i in (0, 17, len(a.train_set) - 1):
        assert all(torch.equal(u, v) for u, v in zip(a.train_set[i], b.train_set[i]))
    corpus = tokenize(load_corpus("pydoc"))
    split = int(corpus.numel() * 0.95)
    x_val, _ = a.val_set[0]
    assert torch.equal(x_val, corpus[split : split + 32])  # validation is the tail of the corpus
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    xv, _ = next(iter(a.val_dataloader()))
    assert torch.equal(xv[0], x_val)  # validation is not shuffled


def test_text_file_source_and_unknown_source(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("hello world " * 50)
    dm = TextDataModule(seq_len=16, batch_size=2, source=str(path))
    dm.setup("fit")
    assert dm.train_set is not None and len(dm.train_set) > 10
    with pytest.raises(ValueError, match="pydoc"):
        TextDataModule(seq_len=16, batch_size=2, source="no/such/corpus").setup("fit")
    with pytest.raises(ValueError, match="val_fraction"):
        TextDataModule(seq_len=16, val_fraction=1.5)


def test_resumable_loader_continues_mid_epoch() -> None:
    """examples/data.py [Note: resuming mid-epoch]: restored at (epoch 1, 3 batches done), the loader yields
    exactly the rest of epoch 1 an uninterrupted loader yields, on each of 2 ranks; other epochs are whole."""
    import torch

    from data import ResumableLoader, ResumableSampler

    data = torch.arange(100)

    def loader(rank: int) -> ResumableLoader:
        sampler = ResumableSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7)
        return ResumableLoader(data, batch_size=4, sampler=sampler, drop_last=True, position=lambda: {})

    for rank in (0, 1):
        full, resumed = loader(rank), loader(rank)
        full.sampler.set_epoch(1)
        expected = [b.tolist() for b in full][3:]
        resumed.load_state_dict({"epoch": 1, "batches": 3})
        resumed.sampler.set_epoch(1)
        assert [b.tolist() for b in resumed] == expected
        assert len(resumed) == len(full)  # Lightning's restored counters expect the epoch's full length
        resumed.sampler.set_epoch(2)
        full.sampler.set_epoch(2)
        assert [b.tolist() for b in resumed] == [b.tolist() for b in full]  # the skip is used once


def test_without_a_trainer_the_train_loader_is_plain() -> None:
    """Fabric's setup_dataloaders must be free to put its own DistributedSampler in (benchmarks/fabric_worker.py)."""
    from torch.utils.data import DistributedSampler, RandomSampler

    from data import ResumableLoader, TextDataModule

    dm = TextDataModule(seq_len=32, batch_size=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert not isinstance(loader, ResumableLoader) and not isinstance(loader.sampler, DistributedSampler)
    assert isinstance(loader.sampler, RandomSampler)
