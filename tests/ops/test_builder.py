"""The op builder: cache keys, prebuilt libraries, hidden compilers, disabled JIT, the report CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_zero.ops import OPS, get_op
from lightning_zero.ops.builder import csrc_root
from lightning_zero.ops.cpu_adam import CPUAdamBuilder
from lightning_zero.ops.report import render_table

REPO = Path(__file__).resolve().parents[2]

# Runs CPUAdam and sign packing, checks them against the references, and
# reports which path ran and every warning, as JSON on the last line.
_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        from lightning_zero.ops import OPS, pack_signs
        from lightning_zero.ops.sign_pack import pack_signs_reference
        from lightning_zero.optim import CPUAdam, FusedAdam, FusedLamb
        from lightning_zero.optim.reference import adam_step_reference
        p = torch.randn(100); p64 = p.double(); m = torch.zeros(100, dtype=torch.float64); v = m.clone()
        out = torch.empty(100, dtype=torch.bfloat16)
        opt = CPUAdam([p], lr=1e-2)
        for step in range(1, 6):
            g = torch.randn(100)
            opt.step(grads=[g.bfloat16()], out16=[out])
            adam_step_reference(p64, g.bfloat16().double(), m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                                eps=1e-8, weight_decay=0.0, adamw_mode=True)
        x = torch.randn(1000)
        packed, scales = pack_signs(x, 64)
        ref = pack_signs_reference(x, 64)
        q = torch.randn(10, requires_grad=True); q.grad = torch.randn(10)
        FusedAdam([q]).step(); FusedLamb([q]).step()
    print(json.dumps({
        "adam_err": (p.double() - p64).abs().max().item(),
        "copy_ok": bool(torch.equal(out, p.bfloat16())),
        "pack_ok": bool(torch.equal(packed, ref[0])) and bool(torch.allclose(scales, ref[1])),
        "loaded": {name: op.cache.module is not None for name, op in OPS.items()},
        "warnings": [str(w.message) for w in caught],
    }))
    """
)


def _run(env_extra: dict[str, str], *args: str, script: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"CXX", "LIGHTNING_ZERO_DISABLE_JIT"}}
    env.update(env_extra)
    cmd = [sys.executable, "-c", script] if script is not None else [sys.executable, "-m", "lightning_zero.ops", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "hide", [{"CXX": "/nonexistent"}, {"LIGHTNING_ZERO_DISABLE_JIT": "1"}], ids=["no_compiler", "jit_disabled"]
)
def test_everything_works_with_the_compiler_hidden(hide: dict[str, str], tmp_path: Path) -> None:
    """Empty cache + hidden compiler: fallbacks give the same numbers and each op warns exactly once."""
    proc = _run({**hide, "LIGHTNING_ZERO_BUILD_DIR": str(tmp_path)}, script=_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["adam_err"] < 1e-5 and result["copy_ok"] and result["pack_ok"]
    assert not any(result["loaded"].values())
    fallbacks = [w for w in result["warnings"] if "is unavailable" in w]
    assert sorted(w.split("'")[1] for w in fallbacks) == ["cpu_adam", "sign_pack_cpu"]
    expected = "no C++ compiler" if "CXX" in hide else "JIT disabled by LIGHTNING_ZERO_DISABLE_JIT=1"
    assert all(expected in w for w in fallbacks)
    report = _run({**hide, "LIGHTNING_ZERO_BUILD_DIR": str(tmp_path)}, "report")
    assert report.returncode == 0 and "| cpu_adam | cpu | no | no | no |" in report.stdout
    assert expected in report.stdout and "falls back to torch's fused CPU Adam" in report.stdout
    assert "Runs a slower fallback instead (see notes): cpu_adam, cpu_adam_lowp, sign_pack_cpu." in report.stdout


def test_prebuilt_ops_load_without_compiler(cpu_adam_op: object, sign_pack_cpu_op: object) -> None:
    """What `python -m lightning_zero.ops build` leaves is used by runs without JIT and compiler."""
    proc = _run({"CXX": "/nonexistent", "LIGHTNING_ZERO_DISABLE_JIT": "1"}, script=_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"]["cpu_adam"] and result["loaded"]["sign_pack_cpu"]
    assert result["adam_err"] < 1e-5 and result["copy_ok"] and result["pack_ok"]
    assert not any("cpu_adam" in w or "sign_pack_cpu" in w for w in result["warnings"])


def test_report_cli_lists_every_op() -> None:
    proc = _run({}, "report")
    assert proc.returncode == 0, proc.stderr
    for name in OPS:
        assert f"| {name} |" in proc.stdout
    assert "TORCH_CUDA_ARCH_LIST" in proc.stdout or "CUDA arch list" in proc.stdout


def _row(stdout: str, name: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_report_says_what_runs_on_a_machine_without_gpu() -> None:
    """Issue #14: the report called the CUDA ops "compatible" on a machine without a GPU. They may well
    build here (nvcc, CI's compile check), but they do not run: the report says so, and why."""
    proc = _run({}, "report")
    assert proc.returncode == 0, proc.stderr
    header = _row(proc.stdout, "op")
    assert header[:5] == ["op", "device", "runs here", "builds here", "built"] and "compatible" not in header
    for name, op in OPS.items():
        row = dict(zip(header, _row(proc.stdout, name)))
        assert row["device"] == op.device
        if op.device == "cuda":
            assert row["runs here"] == "no", row
            assert "no CUDA" in row["why not / notes"] or "no CUDA GPU visible" in row["why not / notes"], row
            assert "not used on this machine" in row["why not / notes"], row
        else:
            assert row["runs here"] == row["builds here"], row  # built on first use where it can be built
    cuda = [name for name, op in OPS.items() if op.device == "cuda"]
    assert f"Not used here (no CUDA device): {', '.join(cuda)}." in proc.stdout


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)


@pytest.mark.parametrize(
    ("arch_list", "runs"),
    [("9.0", True), ("8.0;9.0+PTX", True), ("8.0+PTX", True), ("8.0", False), ("9.0a", True), ("10.0", False)],
)
def test_cuda_op_runs_only_on_a_gpu_its_build_covers(
    monkeypatch: pytest.MonkeyPatch, arch_list: str, runs: bool
) -> None:
    """With a (faked) H100/H200, compute capability 9.0: the op runs where the arch list covers it."""
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    ok, why = type(get_op("fused_adam"))().runtime_check()
    assert ok == runs, why
    if not runs:
        assert "9.0" in why and arch_list in why and "TORCH_CUDA_ARCH_LIST" in why


def test_cuda_op_row_with_a_gpu_but_no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU is there but the op cannot be built: it does not run, and its fallback does."""
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    builder = type(get_op("fused_adam"))()
    monkeypatch.setattr(builder, "is_compatible", lambda: (False, "nvcc not found"))
    status = builder.status()
    assert status.device_present and not status.runs and not status.compatible
    table = render_table([status])
    assert "| fused_adam | cuda | no | no |" in table and "nvcc not found; falls back to a Triton kernel" in table


def test_bad_arch_list_makes_cuda_ops_incompatible_not_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0b")
    ok, why = type(get_op("fused_adam"))().is_compatible()
    assert not ok and "9.0b" in why


def test_cache_key_follows_sources_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = CPUAdamBuilder()
    key = builder.build_key()
    assert key == CPUAdamBuilder().build_key()
    monkeypatch.setattr(CPUAdamBuilder, "cxx_flags", lambda self: ["-O2"])
    assert builder.build_key() != key
    assert builder.ext_name().startswith("lz_cpu_adam_")


def test_missing_sources_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_zero.ops.builder.csrc_root", lambda: None)
    builder = CPUAdamBuilder()
    ok, why = builder.is_compatible()
    assert not ok and why.startswith("sources not found")
    assert "sources not found" in render_table([builder.status()])


def test_sources_are_found_in_this_checkout() -> None:
    root = csrc_root()
    assert root is not None and (root / "cpu_adam" / "cpu_adam.cpp").is_file()
