"""Sign packing: compiled CPU op against the pure-torch reference (csrc/compression)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from lightning_zero.ops import pack_signs, unpack_signs
from lightning_zero.ops.sign_pack import pack_signs_reference, unpack_signs_reference


@pytest.mark.parametrize(("n", "chunk"), [(1, 8), (13, 8), (4096, 1024), (100_003, 40_000), (70_001, 16_392)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_pack_unpack_match_reference(sign_pack_cpu_op: ModuleType, n: int, chunk: int, dtype: torch.dtype, scale: str) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0] = -0.0
    packed, scales = pack_signs(x, chunk, scale)
    ref_packed, ref_scales = pack_signs_reference(x, chunk, scale)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    out = unpack_signs(packed, scales, n, chunk, dtype=dtype)
    assert torch.equal(out, unpack_signs_reference(packed, scales, n, chunk, dtype))


def test_semantics_of_the_reference() -> None:
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, float("nan"), 3.0, -1.0, 2.0, -4.0, 4.0])
    packed, scales = pack_signs_reference(x[:8].nan_to_num(), 8, "mean_abs")
    assert packed.tolist() == [0b10111101]  # bit k = element k >= 0 (0.0 and -0.0 count as positive)
    assert scales.tolist() == [pytest.approx(9 / 8)]
    packed, scales = pack_signs_reference(x, 8, "rms")
    assert packed.tolist() == [0b10101101, 0b10]  # NaN's bit is 0; pad bits are 0
    out = unpack_signs_reference(packed, torch.tensor([1.0, 2.0]), 10, 8)
    assert out.tolist() == [1, -1, 1, 1, -1, 1, -1, 1, -2, 2]


def test_unpack_into_out_and_bad_chunks(sign_pack_cpu_op: ModuleType) -> None:
    x = torch.randn(64)
    packed, scales = pack_signs(x, 16)
    out = torch.empty(8, 8, dtype=torch.bfloat16)
    assert unpack_signs(packed, scales, 64, 16, out=out) is out
    assert torch.equal(out.view(-1), unpack_signs_reference(packed, scales, 64, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(x, 12)


def test_float64_input_uses_the_reference() -> None:
    x = torch.randn(100, dtype=torch.float64)
    packed, scales = pack_signs(x, 32, "mean_abs")
    ref = pack_signs_reference(x, 32, "mean_abs")
    assert torch.equal(packed, ref[0]) and torch.equal(scales, ref[1])
