"""Forked DataLoader workers never inherit the offload buffers (pinned.py [Note: forked workers]).

Checked the way the kernel sees it: a forked child lists its mappings in /proc/self/maps, and an
offload buffer's pages must not be among them (so the parent's writes copy nothing). A plain torch
tensor of the same size is the control: the child does inherit it, so the check can fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.offload.pinned import HostPool, aligned_empty
from tests.offload.helpers import fit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK and /proc are Linux's")


def inherited_by_child(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor: is its first byte mapped in a process forked now?"""
    addrs = [t.data_ptr() for t in tensors]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: read its own mappings, answer, leave without running any cleanup
        try:
            spans = []
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    spans.append((lo, hi))
            os.write(w, bytes(int(any(lo <= a < hi for lo, hi in spans)) for a in addrs))
        finally:
            os._exit(0)
    os.close(w)
    answer = b""
    while chunk := os.read(r, 4096):
        answer += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert len(answer) == len(addrs)
    return [bool(b) for b in answer]


def test_pool_and_aligned_buffers_stay_out_of_children() -> None:
    pool = HostPool(pin=False)
    control = torch.ones(1 << 20)
    bufs = [pool.empty(1 << 20, torch.float32), pool.zeros(3000, torch.bfloat16), aligned_empty(5000, torch.float32)]
    for b in bufs:
        b.fill_(1)  # touched pages: a fork would have shared them
    assert inherited_by_child([control, *bufs]) == [True, False, False, False]
    assert all(b.data_ptr() % 4096 == 0 for b in bufs)
    assert torch.equal(bufs[2], torch.ones(5000))  # the parent's view is untouched


@pytest.mark.parametrize("stage,offload", [
    (2, dict(offload_optimizer="cpu")),
    (3, dict(offload_optimizer="cpu", offload_params="cpu")),
    (3, dict(offload_optimizer="nvme", offload_params="cpu", nvme_fraction=0.5, nvme_chunk_mb=0.004)),
])
def test_offload_state_is_not_inherited_by_forked_workers(tmp_path: Path, stage: int, offload: dict) -> None:
    """Masters, moments, gradient landing and upload buffers, 16-bit partitions, NVMe chunks kept in memory."""
    if offload["offload_optimizer"] == "nvme":
        offload["nvme_path"] = str(tmp_path)
    t, model = fit(steps=2, precision="bf16-mixed", stage=stage, **offload)
    e = t.strategy.engines[0]
    host = [hg.landing for hg in e._grads] + [u for ups in e._uploads for u in ups]
    if offload["offload_optimizer"] == "cpu":
        host += [fg.master for fg in e.groups]
        host += [v for st in t.optimizers[0].state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    else:
        host += list(e._opt_store._mem.values())
        assert len(e._opt_store._mem) > 0  # some chunks stay in memory at nvme_fraction 0.5
    if offload.get("offload_params") == "cpu":
        host += [fg.shard16 for fg in e.groups]
    assert len(host) >= 3
    assert inherited_by_child([torch.ones(1 << 20), *host]) == [True] + [False] * len(host)
