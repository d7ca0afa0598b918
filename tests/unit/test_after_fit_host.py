"""The host-memory bound of lightning_zero/after_fit.py: the fp32 copies a fit hands back (one per rank of a node)
must fit in HOST_SHARE of the free host memory, or the module keeps its 16-bit weights with one warning. (The
device bound, twice the fp32 bytes free on the GPU, runs in the gpu-marked tests/distributed/test_after_fit.py.)"""

from __future__ import annotations

import pytest
import torch

from lightning_zero import after_fit
from lightning_zero.engines import Engines


class _Engines:
    """What fits_on_host and restore_module read of :class:`Engines`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.orig_dtypes = {k: torch.float32 for k in module.state_dict()}
        self.orig_buffer_dtypes: dict[str, torch.dtype] = {}


def _module() -> torch.nn.Module:
    return torch.nn.Linear(256, 256).to(torch.bfloat16)  # 65,792 parameters, fp32 as built: 263,168 bytes


def test_room_is_counted_in_the_users_dtypes_per_rank_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module()
    engines: Engines = _Engines(module)  # type: ignore[assignment]
    monkeypatch.setattr(after_fit, "available_host_bytes", lambda: 4 * 263_168 * 2)
    assert after_fit.fits(engines, module, ranks_per_node=4) == (True, "")
    ok, short = after_fit.fits(engines, module, ranks_per_node=5)
    assert not ok and "host memory (5 ranks per node)" in short, short


def test_without_room_the_16bit_module_stays_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module()
    monkeypatch.setattr(after_fit, "available_host_bytes", lambda: 1000)

    def never() -> dict:
        raise AssertionError("gathered although it does not fit")

    with pytest.warns(UserWarning, match="keeps its 16-bit training weights"):
        assert after_fit.restore_module(_Engines(module), module, never, ranks_per_node=2) is False  # type: ignore[arg-type]
    assert module.weight.dtype == torch.bfloat16
