"""Runs of scenario ``sequence.runs`` (tests/sequence/sp_model_worker.py): ring and Ulysses attention over the
ranks against one-process attention. SPEC is ``key=value`` pairs joined by ``,``: impl (ring|ulysses), layout (zigzag|contiguous), causal (0|1),
doc (1: a packed batch of documents of different lengths), heads, kv_heads, seq, dtype (float32|bfloat16).
Every rank builds the same full ``q, k, v`` and output gradient, runs the reference on the whole sequence,
runs the parallel attention on its own tokens and records the relative error of its output and of its
``q, k, v`` gradients against the reference's rows for those tokens, and how many block pairs went
through the fused kernels (ring.py [Note: fused blocks]). Rank 0 writes ``OUT/NAME.pt``.
``mem=1`` (one document per row, causal) records memory instead, counted by storage: the bytes autograd
saves for the backward in the parallel attention and in SDPA's causal attention over the whole sequence on
one process, and, for ring attention, the peak live bytes of the key/value blocks received from the other
ranks (forward; and in the backward, where each block travels with its gradient accumulators).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_zero.sequence import SequenceLayout, attention_reference, ring_attention, ulysses_attention  # noqa: E402
from tests.helpers.compare import tensor_rel  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.helpers.worker_io import save_result  # noqa: E402


def packed_docs(batch: int, seq: int) -> torch.Tensor:
    """Document ids of a packed batch: row b holds documents of lengths that differ per row."""
    doc = torch.zeros(batch, seq, dtype=torch.int64)
    for b in range(batch):
        cuts = sorted({(seq * (b + 1)) // (b + 3), (seq * 2) // 3 + b})
        for c in cuts:
            doc[b, c:] += 1
    return doc


def saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for the backward while ``fn`` runs, and its result."""
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return storage_bytes(seen), result


class ReceivedBlocks:
    """Peak live bytes of the buffers ring attention receives into (ring._rotate's), by weak references."""

    def __init__(self) -> None:
        import lightning_zero.sequence.ring as ring

        self.ring, self.original, self.live, self.peak = ring, ring._rotate, {}, 0

    def _rotate(self, tensors, group):
        from torch.multiprocessing.reductions import StorageWeakRef

        bufs, works = self.original(tensors, group)
        for b in bufs:
            self.live[StorageWeakRef(b.untyped_storage())] = b.untyped_storage().nbytes()
        self.live = {ref: nbytes for ref, nbytes in self.live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(self.live.values()))
        return bufs, works

    def __enter__(self) -> "ReceivedBlocks":
        self.ring._rotate = self._rotate
        return self

    def __exit__(self, *exc) -> None:
        self.ring._rotate = self.original


class FusedCalls:
    """Counts ring attention's calls of the fused kernels (flash.forward / flash.backward: ring.py
    [Note: fused blocks]) by wrapping them while the block runs."""

    def __init__(self) -> None:
        import lightning_zero.sequence.flash as flash

        self.flash, self.calls = flash, {"forward": 0, "backward": 0}
        self.original = {name: getattr(flash, name) for name in self.calls}

    def _counted(self, name: str):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return self.original[name](*args, **kwargs)

        return call

    def __enter__(self) -> "FusedCalls":
        for name in self.calls:
            setattr(self.flash, name, self._counted(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.original.items():
            setattr(self.flash, name, fn)


def run_memory(name: str, spec: str, out: str, opts: dict[str, str]) -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    heads, kv_heads, seq = int(opts.get("heads", 4)), int(opts.get("kv_heads", opts.get("heads", 4))), int(opts["seq"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seq, 16, generator=g) for h in (heads, kv_heads, kv_heads))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_saved, _ = saved_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(
        *full, is_causal=True, enable_gqa=kv_heads != heads))
    layout = SequenceLayout(seq, n, opts.get("layout", "zigzag"))
    local = [layout.shard(t, r, dim=2).clone().requires_grad_() for t in (q, k, v)]
    fn = ring_attention if opts["impl"] == "ring" else ulysses_attention
    forward, backward = ReceivedBlocks(), ReceivedBlocks()
    with forward:
        saved, got = saved_bytes(lambda: fn(*local, layout, None))
    with backward:
        got.backward(torch.ones_like(got))
    save_result({"spec": spec}, {"saved": saved, "ref_saved": ref_saved, "kv_block": storage_bytes(local[1:]),
                                 "received_forward": forward.peak, "received_backward": backward.peak}, out, name)


def run(name: str, spec: str, out: str) -> None:
    opts = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    if opts.get("mem") == "1":
        return run_memory(name, spec, out, opts)
    n, r = dist.get_world_size(), dist.get_rank()
    heads, kv_heads = int(opts.get("heads", 4)), int(opts.get("kv_heads", opts.get("heads", 4)))
    seq, batch, dim = int(opts.get("seq", 32)), 2, 8
    causal = opts.get("causal", "1") == "1"
    dtype = getattr(torch, opts.get("dtype", "float32"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g).to(dtype)
    dout = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
    doc = packed_docs(batch, seq) if opts.get("doc") == "1" else None

    full = [t.clone().float().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*full, doc=doc, causal=causal)
    ref.backward(dout.float())

    layout = SequenceLayout(seq, n, opts.get("layout", "zigzag"))
    local = [layout.shard(t, r, dim=2).clone().requires_grad_() for t in (q, k, v)]
    local_doc = layout.shard(doc, r, dim=1) if doc is not None else None
    fn = ring_attention if opts.get("impl", "ring") == "ring" else ulysses_attention
    with FusedCalls() as fused:
        got = fn(*local, layout, None, doc=local_doc, causal=causal)
        got.backward(layout.shard(dout, r, dim=2))

    errors = {"out": tensor_rel(got.float(), layout.shard(ref.detach(), r, dim=2))}
    for key, mine, whole in zip("qkv", local, full):
        errors[f"d{key}"] = tensor_rel(mine.grad.float(), layout.shard(whole.grad, r, dim=2))
    save_result({"spec": spec}, {"errors": errors, "dtype": str(got.dtype), "local_len": got.shape[2],
                                 "fused": fused.calls}, out, name)

