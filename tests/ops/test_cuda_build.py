"""CUDA ops compile with the machine's nvcc for sm_90 and link into importable extensions.

Nothing runs on a GPU here: this is the CI guard that a broken kernel or binding
never lands. The kernels are torch-free and the bindings are built without
CUDA headers, so a CPU-only machine with nvcc builds everything.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lightning_zero.ops import get_op
from lightning_zero.ops.builder import CUDAOpBuilder, csrc_root

CUDA_OPS = {"fused_adam": "adam_step", "fused_lamb": "lamb_step", "sign_pack_cuda": "pack"}


def _fresh(name: str) -> CUDAOpBuilder:
    builder = type(get_op(name))()
    assert isinstance(builder, CUDAOpBuilder)
    toolkit, why = builder.toolkit()
    if toolkit is None:
        pytest.skip(f"nvcc is absent, CUDA sources cannot be compile-checked: {why}")
    return builder


@pytest.mark.parametrize("name", sorted(CUDA_OPS))
def test_cuda_op_compiles_for_sm90_and_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    builder = _fresh(name)
    assert builder.arch_flags() == ["-gencode=arch=compute_90,code=sm_90"]
    ok, why = builder.is_compatible()
    if not ok and "compiler" in why:
        pytest.skip(why)
    assert ok, why
    module = builder.load()
    assert hasattr(module, CUDA_OPS[name])


@pytest.mark.parametrize("spec", ["9.0a", "8.6+PTX"])
def test_nvcc_takes_arch_suffixes(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arch strings that crash DeepSpeed's builder compile here (sign_pack.cu: the quickest kernel)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", spec)
    builder = _fresh("sign_pack_cuda")
    root = csrc_root()
    assert root is not None
    cmd = builder.nvcc_command(root / "compression" / "sign_pack.cu", tmp_path / "sign_pack.o")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
