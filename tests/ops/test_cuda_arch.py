"""TORCH_CUDA_ARCH_LIST parsing: every spelling users and CI machines produce."""

from __future__ import annotations

import pytest

from lightning_zero.ops.cuda_arch import CudaArch, covers, gencode_flags, parse_arch_list, resolve_arch_list


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("9.0", [CudaArch("90", False)]),
        ("9.0a", [CudaArch("90a", False)]),  # DeepSpeed 0.19.8 crashes on this one
        ("8.6+PTX", [CudaArch("86", True)]),
        ("8.0;9.0+PTX", [CudaArch("80", False), CudaArch("90", True)]),
        ("7.5 8.0,8.6", [CudaArch("75", False), CudaArch("80", False), CudaArch("86", False)]),
        ("sm_90a", [CudaArch("90a", False)]),
        ("90", [CudaArch("90", False)]),
        ("12.0f", [CudaArch("120f", False)]),
        ("10.0+ptx", [CudaArch("100", True)]),
        ("Hopper", [CudaArch("90", True)]),
        ("9.0;9.0", [CudaArch("90", False)]),
    ],
)
def test_parse_arch_list(spec: str, expected: list[CudaArch]) -> None:
    assert parse_arch_list(spec) == expected


@pytest.mark.parametrize("spec", ["", "9", "nine", "9.0b", "9.0+SASS", ";"])
def test_parse_arch_list_rejects_garbage_with_the_token(spec: str) -> None:
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        parse_arch_list(spec)


def test_gencode_flags() -> None:
    assert gencode_flags("9.0a;8.6+PTX") == [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_86,code=compute_86",
    ]


def test_env_var_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert resolve_arch_list() == ("9.0a", "TORCH_CUDA_ARCH_LIST")


@pytest.mark.parametrize(
    ("spec", "capability", "runs"),
    [
        ("9.0", (9, 0), True),
        ("8.0", (8, 6), True),  # machine code runs on later minors of its major
        ("8.6", (8, 0), False),
        ("8.0", (9, 0), False),  # ... not on a later major
        ("8.0+PTX", (9, 0), True),  # PTX is JIT-compiled for newer GPUs
        ("9.0+PTX", (8, 9), False),
        ("9.0a", (9, 0), True),
        ("9.0a", (9, 1), False),  # arch-specific: that GPU only
        ("12.0f", (12, 1), True),
        ("8.0;9.0+PTX", (12, 0), True),
        ("Hopper", (10, 0), True),
    ],
)
def test_covers(spec: str, capability: tuple[int, int], runs: bool) -> None:
    assert covers(spec, capability) == runs
