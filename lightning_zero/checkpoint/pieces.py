"""What one rank hands torch.distributed.checkpoint: ranges of flattened tensors, and the planners
that find them again.

[Note: every tensor is stored flattened]
A ZeRO partition cuts parameters at arbitrary element offsets (zero/partition.py), which no
rectangular chunk of a multi-dimensional tensor can describe. So every tensor of a sharded
checkpoint is stored as the 1-D flattening of its full value (its real shape is in ``meta.pt``), and
each rank writes the contiguous range of elements it owns as one chunk. torch.distributed.checkpoint
then does the resharding: a rank that owns a different range on load reads exactly the overlapping
pieces of whatever chunks the writers produced, whatever their stage or world size.

``FlatPiece`` speaks DCP's chunk protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, as DTensor does), but is not a tensor, so the two planners below resolve
it to its local storage themselves (DCP's own lookup only handles tensor subclasses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass
class FlatPiece:
    """Elements ``[start, start + source.numel())`` of a flattened tensor of ``numel`` elements,
    held locally in ``source`` (1-D, contiguous; written from, or read into, in place)."""

    source: Tensor
    start: int
    numel: int

    def __post_init__(self) -> None:
        if self.source.dim() != 1 or not self.source.is_contiguous():
            raise ValueError("FlatPiece.source must be a contiguous 1-D tensor")
        if not 0 <= self.start <= self.start + self.source.numel() <= self.numel:
            raise ValueError(f"piece [{self.start}, +{self.source.numel()}) outside a tensor of {self.numel}")

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=torch.Size([self.source.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self.start])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self.chunk,
                    properties=TensorProperties(dtype=self.source.dtype),
                    size=torch.Size([self.numel]),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        return self.source


def _resolve(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict.get(index.fqn)
    if isinstance(obj, FlatPiece):
        return obj.source
    return None


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a flat dict of FlatPieces, tensors and picklable objects
    (no nested-dict flattening: the keys are already flat). Replicated entries (the same key and
    offset on several ranks) are written once, by the rank with the least to write."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _resolve(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over FlatPieces (read in place into their sources), tensors (read in
    place) and objects (replaced in the dict by what was stored). ``allow_partial_load``: keys the
    checkpoint lacks are left alone (checked by the caller, who knows which are optional)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's version first maps every value through a helper that turns unknown objects (FlatPiece)
        # into None; nothing here needs its meta-device initialisation or flattening
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        found = _resolve(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)
