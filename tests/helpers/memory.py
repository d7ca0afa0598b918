"""Count the bytes of distinct tensor storages (memory claims are measured, not computed)."""

from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the sizes of the distinct storages behind ``tensors`` (views are counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
