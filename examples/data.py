"""A real text corpus that needs no download: byte-level tokens of Python's own documentation.

Every CPython ships the English text of its reference documentation's topics in
``pydoc_data.topics.topics`` (what ``help("with")`` prints): ~450 KB of prose and code. Byte-level
tokens (vocab 256) need no tokenizer, and ids < 256 are valid for any larger vocabulary too, so the same
data feeds the 50304-vocab benchmark model. Any UTF-8 text file can be used instead (``source=<path>``).

Samples are fixed-stride windows; the first ``1 - val_fraction`` of the corpus is train, the rest
validation (a split by position, so no validation text leaks into training through overlapping windows).
Everything is deterministic: the corpus is the same on every rank, shuffling is the sampler's (seeded
like Lightning's own DistributedSampler, by ``seed_everything``'s seed and the epoch).

Resumable mid-epoch: the training loader is a :class:`ResumableLoader`, which Lightning saves into every
checkpoint and restores on ``ckpt_path=...`` (its ``state_dict``/``load_state_dict``), so a run killed at step
N and resumed sees exactly the batches the uninterrupted run would have seen ([Note: resuming mid-epoch]).
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

SOURCES = ("pydoc",)
"""Built-in corpora; anything else given as ``source`` is read as a path to a UTF-8 text file."""


@dataclass
class DataConfig:
    """What :class:`TextDataModule` loads; ``conf/data/*.yaml`` are presets of it."""

    seq_len: int
    """Tokens per sample (the model's context length)."""
    batch_size: int = 16
    """Samples per batch, per process (a micro-batch)."""
    val_fraction: float = 0.05
    """Trailing fraction of the corpus held out for validation."""
    num_workers: int = 0
    """DataLoader worker processes (the data is in memory; 0 is usually fastest)."""
    source: str = "pydoc"
    """'pydoc' (Python's bundled documentation text) or a path to a UTF-8 text file."""
    stride: Optional[int] = None
    """Distance between window starts; None means seq_len (non-overlapping windows)."""


def load_corpus(source: str = DataConfig.source) -> bytes:
    """The raw corpus as UTF-8 bytes, in a fixed order (topics sorted by name)."""
    if source == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"Unknown data source {source!r}: expected one of {list(SOURCES)} or a text file path.")
    return path.read_bytes()


def tokenize(text: bytes) -> Tensor:
    """Byte-level tokens: one id in [0, 256) per byte."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.long)


class WindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """Next-token pairs (x, y = x shifted by one) from fixed-stride windows over a token stream."""

    def __init__(self, tokens: Tensor, seq_len: int, stride: int) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"Corpus of {tokens.numel()} tokens is too short for seq_len {seq_len}.")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride
        self.n = (tokens.numel() - seq_len - 1) // stride + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


# [Note: resuming mid-epoch]
# Lightning restores a loader that has ``state_dict``/``load_state_dict`` (its ``_Stateful`` check) before it
# iterates it; anything else restarts the epoch from its first batch, so a resumed run would see batches
# twice. The position saved is the number of batches the *training loop* has finished in this epoch, read
# from the trainer's progress when the checkpoint is written, not the batches the loader has yielded: the
# loop fetches one batch ahead, so the loader's own count is one too many at every mid-epoch checkpoint.
# The skip happens in the sampler (indices only: no skipped sample is loaded), and only in the epoch the
# checkpoint was written in; ``len()`` stays the epoch's full length, which is what Lightning's restored
# batch counters expect.


class ResumableSampler(DistributedSampler):
    """Lightning's DistributedSampler (same seed, same per-epoch shuffle, same split over ranks) that can
    start an epoch part-way through. Being a DistributedSampler, Lightning keeps it as it is (no re-made
    loader) and calls its ``set_epoch``."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.resume: Optional[tuple[int, int]] = None
        """(epoch, samples to skip) set by :meth:`ResumableLoader.load_state_dict`; used once."""

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self.resume is not None and self.resume[0] == self.epoch:
            indices = indices[self.resume[1]:]
        self.resume = None
        return iter(indices)


class ResumableLoader(DataLoader):
    """A DataLoader Lightning saves and restores with the checkpoint ([Note: resuming mid-epoch])."""

    def __init__(self, *args: Any, position: Callable[[], dict[str, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position
        """(epoch, batches the training loop finished in it): the trainer's progress at save time."""

    def state_dict(self) -> dict[str, int]:
        return dict(self.position())

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        if isinstance(sampler, ResumableSampler) and state:
            sampler.resume = (int(state["epoch"]), int(state["batches"]) * int(self.batch_size or 1))


class TextDataModule(L.LightningDataModule):
    """Train/validation windows over a byte-level corpus (see the module docstring)."""

    def __init__(
        self,
        seq_len: int,
        batch_size: int = DataConfig.batch_size,
        val_fraction: float = DataConfig.val_fraction,
        num_workers: int = DataConfig.num_workers,
        source: str = DataConfig.source,
        stride: Optional[int] = DataConfig.stride,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.cfg = DataConfig(seq_len, batch_size, val_fraction, num_workers, source, stride)
        self.train_set: Optional[WindowDataset] = None
        self.val_set: Optional[WindowDataset] = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        c = self.cfg
        tokens = tokenize(load_corpus(c.source))
        split = int(tokens.numel() * (1.0 - c.val_fraction))
        stride = c.stride or c.seq_len
        self.train_set = WindowDataset(tokens[:split], c.seq_len, stride)
        self.val_set = WindowDataset(tokens[split:], c.seq_len, c.seq_len)

    def _loader(self, dataset: Optional[WindowDataset], shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("TextDataModule.setup() has not run yet.")
        c = self.cfg
        return DataLoader(
            dataset, batch_size=c.batch_size, shuffle=shuffle, drop_last=shuffle,
            num_workers=c.num_workers, persistent_workers=c.num_workers > 0,
        )

    def _position(self) -> dict[str, int]:
        """Where the training loop is: its epoch and the batches it finished in it (read at save time)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        return {"epoch": trainer.current_epoch, "batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled, split over the data-parallel ranks (the strategy's ``distributed_sampler_kwargs``:
        pipeline and tensor-parallel peers get the same batches), resumable mid-epoch. Without a Trainer
        (Fabric, a plain loop) a plain shuffled loader, which ``fabric.setup_dataloaders`` splits over ranks."""
        if self.train_set is None:
            raise RuntimeError("TextDataModule.setup() has not run yet.")
        if self.trainer is None:
            return self._loader(self.train_set, shuffle=True)
        c = self.cfg
        split: dict[str, Any] = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = ResumableSampler(
            self.train_set, num_replicas=int(split.get("num_replicas", 1)), rank=int(split.get("rank", 0)),
            shuffle=True, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),  # Lightning's DistributedSampler's seed
        )
        return ResumableLoader(
            self.train_set, batch_size=c.batch_size, sampler=sampler, drop_last=True, position=self._position,
            num_workers=c.num_workers, persistent_workers=c.num_workers > 0,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


__all__ = [
    "DataConfig", "TextDataModule", "ResumableLoader", "ResumableSampler", "WindowDataset", "load_corpus", "tokenize",
    "SOURCES",
]
