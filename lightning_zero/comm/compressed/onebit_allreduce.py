"""The error-compensated 1-bit all-reduce (average) of 1-bit Adam / 1-bit LAMB, and its plain-torch oracle.

The exchange, for N ranks each holding a vector ``m`` of ``numel`` elements (Tang et al., 2021;
DeepSpeed's ``compressed_allreduce``):

1. *worker*: ``x = pad(m) + worker_error``; compress ``x`` to signs + one scale per block;
   ``worker_error = x - decompress(x)``. ``x`` is cut into N equal *server chunks*.
2. all-to-all: server chunk j (its packed signs and scales) goes to rank j.
3. *server* j: average the N decompressed copies of chunk j, add ``server_error``, compress again,
   ``server_error = y - decompress(y)``.
4. all-gather: every rank receives every server's compressed chunk and decompresses the average.

Per rank, the wire carries ``(N-1)/N * n/8`` bytes of signs in step 2 and ``(N-1) * n/(8N)`` in step
4, plus 4 bytes per block of scales: about 1/16 of a 16-bit ring all-reduce (``2 (N-1)/N * 2n``).

[Note: layout of one exchange]
:class:`OneBitLayout` pads ``numel`` to ``N * server_numel``; ``server_numel`` is a multiple of the
scale ``block`` (itself a multiple of 8, at most the requested one, evened out so that padding
costs less than 8 elements per block), so every server chunk starts on a byte and on a block and
can be sent on its own, and one compress call covers the whole padded vector. One chunk's
payload is ``[signs (server_numel/8 bytes) | scales (4 bytes each)]``, so each step is ONE
collective (latency matters for small models as much as bandwidth does for large ones).

[Note: bit-exact oracle]
:func:`simulate_onebit_allreduce` runs every rank of the algorithm in one process with plain
slicing (no payload packing, no collectives). Both sides perform the same float operations in the
same order (sums over ranks in rank order, then one division by N), so on the same compressor they
agree bit for bit: this is what tests/onebit checks across real gloo processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_zero.comm.compressed.sign import SignCompressor

SCALE_BYTES = 4


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class OneBitLayout:
    """How a vector of ``numel`` elements is padded and cut for one compressed all-reduce."""

    numel: int
    world: int
    block: int
    """Elements per scale (a multiple of 8 that divides ``server_numel``; at most the requested block)."""
    server_numel: int
    """Elements of the chunk each rank reduces (a multiple of ``block``)."""

    @classmethod
    def plan(cls, numel: int, world: int, block: int) -> "OneBitLayout":
        if numel < 1 or world < 1:
            raise ValueError(f"need numel >= 1 and world >= 1, got {numel}, {world}")
        if block <= 0 or block % 8:
            raise ValueError(f"block must be a positive multiple of 8, got {block}")
        per_rank = _round_up(-(-numel // world), 8)
        blocks = -(-per_rank // block)
        block = _round_up(-(-per_rank // blocks), 8)  # <= the requested block, and as even as possible
        return cls(numel, world, block, blocks * block)

    @property
    def padded_numel(self) -> int:
        return self.world * self.server_numel

    @property
    def sign_bytes(self) -> int:
        """Packed sign bytes of one server chunk."""
        return self.server_numel // 8

    @property
    def blocks(self) -> int:
        """Scales of one server chunk."""
        return self.server_numel // self.block

    @property
    def payload_bytes(self) -> int:
        """Bytes of one server chunk's message: signs, then float32 scales."""
        return self.sign_bytes + SCALE_BYTES * self.blocks


@dataclass
class ErrorFeedback:
    """One rank's compression errors for one vector: they make the compression unbiased over time."""

    layout: OneBitLayout
    worker: Tensor
    """``padded_numel`` fp32: what this rank's own compression lost last time."""
    server: Tensor
    """``server_numel`` fp32: what this rank's server-side re-compression lost last time."""

    @classmethod
    def zeros(cls, layout: OneBitLayout, device: torch.device) -> "ErrorFeedback":
        return cls(
            layout,
            torch.zeros(layout.padded_numel, dtype=torch.float32, device=device),
            torch.zeros(layout.server_numel, dtype=torch.float32, device=device),
        )


# ---------------------------------------------------------------------------------------------
# The three local phases of one exchange (the collectives between them are the backend's).


def pack_payload(packed: Tensor, scales: Tensor, layout: OneBitLayout, chunks: int) -> Tensor:
    """``chunks`` messages of ``[signs | scales]`` bytes, one row per server chunk."""
    out = torch.empty(chunks, layout.payload_bytes, dtype=torch.uint8, device=packed.device)
    out[:, : layout.sign_bytes].copy_(packed.view(chunks, layout.sign_bytes))
    out[:, layout.sign_bytes :].copy_(scales.float().contiguous().view(torch.uint8).view(chunks, -1))
    return out


def unpack_payload(row: Tensor, layout: OneBitLayout) -> tuple[Tensor, Tensor]:
    """Signs and scales of one message (scales are copied out: the byte view is unaligned)."""
    signs = row[: layout.sign_bytes]
    scales = row[layout.sign_bytes :].clone().view(torch.float32)
    return signs, scales


def worker_compress(m: Tensor, errors: ErrorFeedback, compressor: SignCompressor) -> Tensor:
    """Step 1: ``x = pad(m) + worker_error``, compressed; ``worker_error = x - decompress(x)``.

    ``m`` is flat, on the errors' device. Returns the all-to-all send buffer: one payload row per
    destination server.
    """
    layout = errors.layout
    n, w = layout.numel, errors.worker
    x = torch.empty(layout.padded_numel, dtype=torch.float32, device=w.device)
    torch.add(m, w[:n], out=x[:n])
    torch.add(w[n:], 0.0, out=x[n:])  # the padding is zero, plus its error
    packed, scales = compressor.compress(x, layout.block)
    compressor.decompress(packed, scales, layout.padded_numel, layout.block, out=w)
    torch.sub(x, w, out=w)
    return pack_payload(packed, scales, layout, layout.world)


def server_reduce(received: Tensor, errors: ErrorFeedback, compressor: SignCompressor) -> tuple[Tensor, Tensor]:
    """Step 3: average the N compressed copies of this rank's chunk, error-compensate, re-compress.

    ``received`` is the all-to-all output (row i came from rank i). Returns this server's message
    and its decompressed value (this rank's piece of the result, so it is not decoded twice).
    """
    layout = errors.layout
    n = layout.server_numel
    acc = torch.empty(n, dtype=torch.float32, device=errors.server.device)
    tmp = torch.empty_like(acc)
    for i in range(layout.world):
        signs, scales = unpack_payload(received[i], layout)
        compressor.decompress(signs, scales, n, layout.block, out=acc if i == 0 else tmp)
        if i:
            acc.add_(tmp)
    acc.div_(layout.world).add_(errors.server)
    packed, scales = compressor.compress(acc, layout.block)
    compressor.decompress(packed, scales, n, layout.block, out=tmp)
    torch.sub(acc, tmp, out=errors.server)
    return pack_payload(packed, scales, layout, 1).view(-1), tmp


def decompress_gathered(
    gathered: Tensor, layout: OneBitLayout, compressor: SignCompressor, out: Tensor, rank: int, own: Tensor
) -> Tensor:
    """Step 4: every server's message (row j from rank j) into the flat ``numel``-element ``out``;
    this rank's chunk is ``own``, already decoded by :func:`server_reduce`."""
    s, n = layout.server_numel, layout.numel
    spare: Optional[Tensor] = None
    for j in range(layout.world):
        lo, hi = j * s, min((j + 1) * s, n)
        if hi <= lo:
            continue  # a chunk of padding only (tiny vectors)
        if j == rank:
            out[lo:hi].copy_(own[: hi - lo])
            continue
        signs, scales = unpack_payload(gathered[j], layout)
        if hi - lo == s:
            compressor.decompress(signs, scales, s, layout.block, out=out[lo:hi])
        else:
            spare = spare if spare is not None else torch.empty(s, dtype=torch.float32, device=out.device)
            compressor.decompress(signs, scales, s, layout.block, out=spare)
            out[lo:hi].copy_(spare[: hi - lo])
    return out


# ---------------------------------------------------------------------------------------------
# The oracle.


def simulate_onebit_allreduce(
    inputs: list[Tensor],
    errors: list[ErrorFeedback],
    compressor: SignCompressor,
) -> list[Tensor]:
    """Every rank of one compressed all-reduce in one process, with plain tensors: the test oracle.

    ``inputs[r]`` is rank r's vector (left untouched), ``errors[r]`` its error buffers (updated in
    place). Returns each rank's result (they are all equal). No payload bytes, no collectives:
    chunks are routed by slicing, so a routing or padding bug in the real exchange shows up as a
    difference.
    """
    world = len(inputs)
    layout = errors[0].layout
    n, s, blk = layout.numel, layout.server_numel, layout.block
    sent: list[tuple[Tensor, Tensor]] = []
    for r in range(world):
        x = torch.zeros(layout.padded_numel, dtype=torch.float32, device=inputs[r].device)
        x[:n] = inputs[r].reshape(-1).float()
        x = x + errors[r].worker
        packed, scales = compressor.compress(x, blk)
        decoded = torch.empty_like(x)
        compressor.decompress(packed, scales, layout.padded_numel, blk, out=decoded)
        errors[r].worker.copy_(x - decoded)
        sent.append((packed, scales))
    result = torch.empty(layout.padded_numel, dtype=torch.float32, device=inputs[0].device)
    for j in range(world):
        acc: Optional[Tensor] = None
        for i in range(world):
            packed, scales = sent[i]
            piece = torch.empty(s, dtype=torch.float32, device=result.device)
            signs_j = packed[j * s // 8 : (j + 1) * s // 8]
            scales_j = scales[j * (s // blk) : (j + 1) * (s // blk)]
            compressor.decompress(signs_j, scales_j, s, blk, out=piece)
            acc = piece if acc is None else acc + piece
        assert acc is not None
        y = acc / world + errors[j].server
        packed, scales = compressor.compress(y, blk)
        decoded = torch.empty_like(y)
        compressor.decompress(packed, scales, s, blk, out=decoded)
        errors[j].server.copy_(y - decoded)
        result[j * s : (j + 1) * s] = decoded
    return [result[:n].clone() for _ in range(world)]
