"""A real text corpus that needs no download: byte-level tokens of Python's own documentation.

Every CPython ships the English text of its reference documentation's topics in
``pydoc_data.topics.topics`` (what ``help("with")`` prints): ~450 KB of prose and code. Byte-level
tokens (vocab 256) need no tokenizer, and ids < 256 are valid for any larger vocabulary too, so the same
data feeds the 50304-vocab benchmark model. Any UTF-8 text file can be used instead (``source=<path>``).

Samples are fixed-stride windows; the first ``1 - val_fraction`` of the corpus is train, the rest
validation (a split by position, so no validation text leaks into training through overlapping windows).
Everything is deterministic: the corpus is the same on every rank, shuffling is the sampler's (seeded
by Lightning's DistributedSampler / ``seed_everything``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
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

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


__all__ = ["DataConfig", "TextDataModule", "WindowDataset", "load_corpus", "tokenize", "SOURCES"]
