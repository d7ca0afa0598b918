"""Sign compressors: one bit per element plus one float32 scale per block of elements.

The 1-bit all-reduce (onebit_allreduce.py) is written against the small :class:`SignCompressor`
interface below, so the algorithm does not care where the bits are packed:

* :class:`KernelSignCompressor` delegates to ``lightning_zero.ops.pack_signs``/``unpack_signs``
  (the compiled CPU/CUDA kernels of csrc/compression, which fall back to their own pure-torch
  reference when they cannot be built), except unpacking on the CPU (see [Note: CPU unpack]);
* :class:`TorchSignCompressor` is plain torch, a few vectorised ops, and needs nothing else.

Both encode the same format (bit k of byte j is element 8j+k, 1 for ``x >= 0`` including -0.0;
pad bits 0; scale = the block's RMS or mean |x|), so their packed bits are interchangeable; scales
may differ in the last float bit (different summation order), which is why one all-reduce uses
one compressor on every rank.

[Note: why sign(0) = +1]
1-bit compression cannot represent an exact zero: a zero maps to +scale. The error-feedback
buffers absorb the difference, but momentum that is *always* zero (padding between flat
parameters, an embedding row never used) would keep oscillating, so the optimizers mask such
positions after every exchange (DeepSpeed's ``exp_avg_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

ScaleMode = Literal["rms", "mean_abs"]
SCALE_MODES: tuple[str, ...] = ("rms", "mean_abs")


class SignCompressor(Protocol):
    """Packs signs of a flat tensor into bytes with one scale per ``block`` elements."""

    name: str
    scale: ScaleMode

    def compress(self, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """``(packed uint8 of ceil(n/8) bytes, float32 scales of ceil(n/block))`` of a flat tensor."""
        ...

    def decompress(self, packed: Tensor, scales: Tensor, numel: int, block: int, out: Tensor) -> Tensor:
        """Write ``scale * (+1 | -1)`` for ``numel`` elements into the contiguous flat ``out``."""
        ...


def _check(block: int, scale: str) -> None:
    if block <= 0 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8, got {block}")
    if scale not in SCALE_MODES:
        raise ValueError(f"scale must be one of {list(SCALE_MODES)}, got {scale!r}")


@dataclass(frozen=True)
class TorchSignCompressor:
    """Pure-torch sign packing (any device, any float dtype; scales accumulated in float32)."""

    scale: ScaleMode = "rms"
    name: str = "torch"

    def __post_init__(self) -> None:
        _check(8, self.scale)

    def compress(self, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        _check(block, self.scale)
        flat = x.reshape(-1)
        n = flat.numel()
        bits = torch.nn.functional.pad((flat >= 0).to(torch.uint8), (0, (-n) % 8)).view(-1, 8)
        packed = bits[:, 0].clone()
        for k in range(1, 8):
            packed.bitwise_or_(bits[:, k] << k)
        values = flat.float().abs() if self.scale == "mean_abs" else flat.float().square()
        padded = torch.nn.functional.pad(values, (0, (-n) % block)).view(-1, block)
        sums = padded.sum(dim=1)
        lengths = torch.full_like(sums, float(block))
        if n % block:
            lengths[-1] = n % block
        means = sums / lengths
        return packed, (means if self.scale == "mean_abs" else means.sqrt())

    def decompress(self, packed: Tensor, scales: Tensor, numel: int, block: int, out: Tensor) -> Tensor:
        _check(block, self.scale)
        return lut_decompress(packed, scales, numel, block, out)


def _sign_table(device: torch.device) -> Tensor:
    """(256, 8) float32: row b holds +1/-1 for the 8 bits of byte b, least significant first."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return bits.float().mul_(2.0).sub_(1.0)


def lut_decompress(packed: Tensor, scales: Tensor, numel: int, block: int, out: Tensor) -> Tensor:
    """Unpack through a 256-entry table of sign patterns, then one multiply by the block scales.

    [Note: CPU unpack] ``index_select`` gathers 32 bytes per packed byte at copy speed; measured on
    the 2-core CI machine for 3.2 M elements: 15 ms, against 40-60 ms for the compiled CPU unpack
    kernel (and 3 ms for a plain copy). ``scale * (+-1.0)`` is exact, so both give the same bits.
    """
    table = _sign_table(packed.device)
    packed = packed.reshape(-1)
    flat = out.view(-1)
    full = numel // block * block
    step = max(1, _LUT_PIECE // block) * block  # pieces keep the +-1 temporary in cache
    for lo in range(0, full, step):
        hi = min(lo + step, full)
        signs = torch.index_select(table, 0, packed[lo // 8 : hi // 8].int()).view(-1, block)
        torch.mul(signs, scales[lo // block : hi // block, None], out=flat[lo:hi].view(-1, block))
    if numel > full:
        signs = torch.index_select(table, 0, packed[full // 8 :].int()).view(-1)
        torch.mul(signs[: numel - full], scales[full // block], out=flat[full:numel])
    return out


_LUT_PIECE = 1 << 18
"""Elements unpacked per piece (1 MiB of +-1 floats)."""


@dataclass(frozen=True)
class KernelSignCompressor:
    """The compiled kernels of ``lightning_zero.ops`` (CPU OpenMP / CUDA), with their own fallback."""

    scale: ScaleMode = "rms"
    name: str = "kernel"
    cpu_unpack: Literal["lut", "kernel"] = "lut"
    """Unpacking on the CPU: the table lookup (faster here, see [Note: CPU unpack]) or the kernel."""

    def __post_init__(self) -> None:
        _check(8, self.scale)

    def compress(self, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        from lightning_zero.ops import pack_signs

        return pack_signs(x, block, self.scale)

    def decompress(self, packed: Tensor, scales: Tensor, numel: int, block: int, out: Tensor) -> Tensor:
        if out.device.type == "cpu" and self.cpu_unpack == "lut":
            return lut_decompress(packed, scales, numel, block, out)  # see [Note: CPU unpack]
        from lightning_zero.ops import unpack_signs

        unpack_signs(packed, scales, numel, block, out=out.view(-1))
        return out


def default_compressor(scale: ScaleMode = "rms") -> SignCompressor:
    """The compiled kernels when the ops package is importable, else plain torch."""
    try:
        import lightning_zero.ops  # noqa: F401
    except Exception:  # pragma: no cover - the ops package is part of lightning_zero
        return TorchSignCompressor(scale)
    return KernelSignCompressor(scale)


def make_compressor(name: str, scale: ScaleMode = "rms") -> SignCompressor:
    """Compressor by name: 'kernel' (compiled ops, default) or 'torch' (pure torch)."""
    if name == "kernel":
        return KernelSignCompressor(scale)
    if name == "torch":
        return TorchSignCompressor(scale)
    raise ValueError(f"compressor must be one of ['kernel', 'torch'], got {name!r}")
