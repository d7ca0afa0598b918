"""Partial offload (``offload_ratio``) on one rank: where the split falls, what 'auto' picks, what the
device share holds, and what is refused (parity with ddp on 2 ranks is in test_parity.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.offload import engine as offload_engine
from lightning_zero.offload.device_share import (
    auto_device_numel, auto_ratio, device_bytes_per_element, split_at_ratio,
)
from lightning_zero.zero.partition import build_layout
from tests.helpers.memory import storage_bytes
from tests.helpers.parity_model import ParityNet
from tests.offload.helpers import fit, rel


def _layout():  # 4 parameters of 100 elements, one bucket each, 2 shards: chunks of 50
    return build_layout([100, 100, 100, 100], 2, 100, align=2)


def test_split_falls_on_the_nearest_bucket_boundary() -> None:
    layout = _layout()
    assert [b.shard_offset for b in layout.buckets] == [0, 50, 100, 150] and layout.shard_numel == 200
    assert split_at_ratio(layout, 1.0) == 200 and split_at_ratio(layout, 0.0) == 0
    assert split_at_ratio(layout, 0.5) == 100
    assert split_at_ratio(layout, 0.3) == 50  # 60 elements wanted: 50 is nearer than 100
    assert split_at_ratio(layout, 0.3, round_host_up=True) == 100  # auto never puts more on the device than fits


def test_auto_sizes_the_device_share_from_the_measured_peak() -> None:
    per = device_bytes_per_element(torch.bfloat16)
    assert per == 18 and device_bytes_per_element(torch.float32) == 16
    total, peak = 100 * 2**20, 50 * 2**20
    fits = auto_device_numel(total, peak, torch.bfloat16)
    assert fits == (int(total * 0.9) - peak) // 18
    assert auto_device_numel(total, total, torch.bfloat16) == 0
    assert auto_ratio([600, 400], 250) == pytest.approx(0.75)
    assert auto_ratio([600, 400], 5000) == 0.0


def test_auto_moves_what_fits_and_trains_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' on a CPU run keeps everything on the host; with a device memory figure injected it moves
    the measured share after the first step, and the run still follows the no-offload run."""
    _, ref = fit(steps=6, stage=2)
    t, model = fit(steps=6, stage=2, offload_optimizer="cpu", offload_ratio="auto")
    e = t.strategy.engines[0]
    assert e._share is None and e._splits == [fg.layout.shard_numel for fg in e.groups]

    numel = 0

    def fake_memory(self: object) -> tuple[int, int]:  # room for about 40% of the partition
        return int((1000 + 0.4 * numel * 16) / 0.9), 900

    monkeypatch.setattr(offload_engine.OffloadMixin, "_device_memory", fake_memory)
    numel = sum(fg.layout.shard_numel for fg in e.groups)
    t, model = fit(steps=6, stage=2, offload_optimizer="cpu", offload_ratio="auto")
    e = t.strategy.engines[0]
    assert e.chosen_ratio == pytest.approx(0.6, abs=0.01)
    assert e._share is not None and 0 < e._share.numel <= 0.4 * numel + 1
    assert rel(model.losses, ref.losses) < 1e-5


def test_device_share_memory_is_counted_per_element() -> None:
    t, _ = fit(steps=2, stage=2, offload_optimizer="cpu", offload_ratio=0.5, precision="bf16-mixed")
    e = t.strategy.engines[0]
    share = e._share
    assert share is not None and 0 < share.numel < sum(fg.layout.shard_numel for fg in e.groups)
    tensors = [getattr(share.group(gi), k) for gi in range(len(e.groups)) if share._groups[gi] is not None
               for k in ("master", "exp_avg", "exp_avg_sq", "grad", "out16")]
    assert storage_bytes(tensors) == 18 * share.numel
    assert all(len(hg.landing) == sp for hg, sp in zip(e._grads, e._splits))  # host landing: the host share only


def test_partial_offload_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="offload_ratio=0.5 needs offload_optimizer"):
        ZeroConfig(stage=2, offload_ratio=0.5)
    with pytest.raises(ValueError, match="delayed_param_update"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_ratio=0.5, delayed_param_update=True)
    with pytest.raises(ValueError, match="number in \\[0, 1\\] or 'auto'"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_ratio=1.5)
    assert ZeroConfig(stage=2, offload_optimizer="cpu", offload_ratio="0.25").offload_ratio == 0.25  # from Hydra
    with pytest.raises(ValueError, match="needs torch.optim.Adam/AdamW"):
        fit(steps=1, stage=2, offload_optimizer="cpu", offload_ratio=0.5, model=ParityNet(optimizer="sgd"))
