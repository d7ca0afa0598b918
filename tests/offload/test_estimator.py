"""The memory estimator: its arithmetic, its scaling, the model-based entry point and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_zero import estimate as cli
from lightning_zero.offload import estimator as est
from tests.helpers.launch import ROOT

P = 10**9
BY_NAME = {s.name: s for s in est.SETTINGS}


def _e(name: str, **kw: object) -> est.Estimate:
    return est.estimate(BY_NAME[name], est.Workload(P, **kw))  # type: ignore[arg-type]


def test_bytes_per_parameter_on_one_gpu() -> None:
    """bf16 + Adam, one GPU: the figures of DESIGN.md section 6 and of the offload paper."""
    # 2 + 2 + 4 + 8, and the fp32 copy of the gradients zero0 steps from (counted in the step by
    # tests/offload/test_estimator_storage.py; issue #28)
    assert _e("zero0").gpu_bytes == 20 * P
    assert _e("zero2_offload").cpu_bytes == 16 * P  # masters 4 + moments 8 + gradient 2 + upload 2
    assert _e("zero2_offload").gpu_bytes == 2 * P + 2 * 2 * 25 * 2**20  # parameters + two gradient buckets
    assert _e("zero3_offload").cpu_bytes == 16 * P  # the step writes the 16-bit partitions in place
    assert _e("zero3_offload_nvme").nvme_bytes == 14 * P  # masters, moments and 16-bit partitions
    half = _e("zero3_offload_nvme", nvme_fraction=0.5)
    assert half.nvme_bytes == 8 * P and half.cpu_bytes == _e("zero3_offload_nvme").cpu_bytes + 6 * P
    assert _e("zero3_offload", compute_bytes=4).cpu_bytes == 20 * P  # fp32: masters are uploaded directly
    assert _e("zero2_offload", accumulate=True).cpu_bytes == 20 * P  # + an fp32 accumulator
    assert _e("zero2_offload", delayed_update=True).cpu_bytes == 20 * P  # two gradient and upload buffers
    # compact host states (6 B/param), built in the fp32 master's memory: no construction peak above these
    assert _e("zero3_offload", state_bytes=6.0).cpu_bytes == 10 * P  # state 6 + gradient 2 + partition 2
    assert _e("zero3_offload", state_bytes=6.0, master_in_params=True).cpu_bytes == 8 * P  # bf16 master = partition
    assert _e("zero2_offload", state_bytes=6.0, master_in_params=True).cpu_bytes == 10 * P  # no host partition there


@pytest.mark.parametrize("setting", [s for s in est.SETTINGS if s.stage >= 1])
def test_scaling_with_ranks(setting: est.Setting) -> None:
    one, eight = est.estimate(setting, est.Workload(P, 1)), est.estimate(setting, est.Workload(P, 8))
    assert eight.gpu_bytes <= one.gpu_bytes  # per device: partitions shrink with the ranks ...
    if setting.offload_params == "none" and (setting.stage == 3 or setting.offload_optimizer == "none"):
        assert eight.gpu_bytes < one.gpu_bytes  # (not where only full parameters or the working set are left)
    ring = 8 * 36 * 64 * 2**20 if setting.offload_optimizer == "nvme" else 0  # each rank's swap buffers
    assert eight.cpu_bytes <= one.cpu_bytes * 1.01 + ring  # per node: 8 ranks x 1/8 each
    assert eight.nvme_bytes == pytest.approx(one.nvme_bytes, rel=1e-6)
    two_nodes = est.estimate(setting, est.Workload(P, 8, nodes=2))
    assert two_nodes.cpu_bytes <= 0.51 * eight.cpu_bytes + ring and two_nodes.nvme_bytes <= 0.51 * eight.nvme_bytes


def test_each_offload_step_moves_memory_off_the_gpu() -> None:
    order = ["zero3", "zero3 optimizer=cpu params=none", "zero3_offload"]
    gpu = [_e(n).gpu_bytes for n in order]
    assert gpu == sorted(gpu, reverse=True) and gpu[-1] < 0.2 * gpu[0]
    assert _e("zero3_offload_nvme").cpu_bytes < 0.5 * _e("zero3_offload").cpu_bytes  # gradients + upload + ring
    assert _e("zero3_offload_nvme").gpu_bytes == _e("zero3_offload").gpu_bytes


def test_estimate_from_a_model_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(1000, 64), nn.ModuleList(nn.Linear(64, 256) for _ in range(3)))
    model[0].weight.requires_grad_(False)  # frozen: not optimised, not counted
    total, unit = est.count_params(model)
    assert (total, unit) == (3 * (64 * 256 + 256), 64 * 256 + 256)
    rows = est.estimate_model(model, gpus_per_node=2)
    assert [r.setting for r in rows] == list(est.SETTINGS)
    assert rows[0].gpu_bytes == 20 * total  # zero0: 2 + 2 + 4 + 8 + the fp32 gradient copy at the step


def test_largest_fitting_model_is_tight() -> None:
    machine = est.Machine(gpu_bytes=80 * est.GIB, cpu_bytes=128 * est.GIB, nvme_bytes=64 * est.GIB)
    for s in est.SETTINGS:
        n, limit = est.largest_fitting(s, machine, lambda p: est.Workload(p))
        assert est.fits(est.estimate(s, est.Workload(n)), machine)
        assert not est.fits(est.estimate(s, est.Workload(int(n * 1.01) + 1)), machine)
        assert limit in ("GPU", "CPU", "NVMe")
    assert est.largest_fitting(BY_NAME["zero3_offload"], machine, lambda p: est.Workload(p))[1] == "CPU"


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--params", "7e9", "--gpus", "1", "--nodes", "1", "--gpu-mem-gib", "80",
                     "--host-mem-gib", "128", "--nvme-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "7.00B parameters on 1 node(s) x 1 GPU(s)" in out
    rows = [line for line in out.splitlines() if line.startswith("| zero")]
    assert len(rows) == len(est.SETTINGS)
    zero0 = next(r for r in rows if r.startswith("| zero0 |"))
    assert "130.4 GiB" in zero0 and "| no |" in zero0  # 20 B/param x 7e9 does not fit 80 GiB
    offload = next(r for r in rows if r.startswith("| zero3_offload |"))
    assert "| yes |" in offload and "(CPU)" in offload


def test_cli_picks_an_nvme_fraction_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """10B parameters, 120 GiB of RAM, 60 GiB of disk: neither alone holds the states, the split does."""
    cli.main(["--params", "10e9", "--gpu-mem-gib", "80", "--host-mem-gib", "120", "--nvme-gib", "60"])
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| zero3 optimizer=nvme params=cpu"))
    assert "(nvme_fraction 0.5)" in row and "| yes |" in row


def test_cli_compact_states_fit_13b_in_125_gib(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-13B's 12.85B parameters on one GPU with 125 GiB of host memory: fp32 host states do not fit,
    bf16 states whose master is the parameter partition (8 B/param) do."""
    args = ["--params", "12.85e9", "--gpu-mem-gib", "139", "--host-mem-gib", "125", "--nvme-gib", "60"]
    rows = {}
    for precision in ("fp32", "bf16_sr"):
        cli.main(args + ["--state-precision", precision])
        rows[precision] = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| zero3_offload |"))
    assert "| no |" in rows["fp32"] and "191.5 GiB" in rows["fp32"]
    assert "| yes |" in rows["bf16_sr"] and "95.7 GiB" in rows["bf16_sr"]


def test_cli_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "lightning_zero.estimate", "--params", "1.3B", "--gpus", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1.30B parameters on 1 node(s) x 2 GPU(s)" in proc.stdout and "| zero3_offload_nvme (nvme_fraction" in proc.stdout


def test_cli_rejects_bad_counts() -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--params", "-5"])
