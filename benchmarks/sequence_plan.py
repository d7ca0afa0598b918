"""What one machine can hold of a long sequence under ``zero3_offload``: the arithmetic behind
``benchmarks/sequence.py longest`` (no torch at import; the offload state bytes come from lightning_zero's
estimator, imported when asked).

[Note: the long-sequence ceiling of one machine]
With parameters and optimizer states in host memory, what grows with the sequence length ``S`` is:

* the layer checkpoints: ``L x S x 2 d`` bytes (bf16 hidden states entering each of the ``L`` decoder
  layers; the rotary tables and position ids are passed by keyword, which torch's checkpoint keeps by
  reference, once for all layers). Llama-8B: 256 KiB per token, 150 GiB at 600K tokens.
* the GPU working set of the layer being recomputed and differentiated (its saved activations, flash
  attention's fp32 gradient accumulator, the gradient flowing back), plus what sits outside the layers for
  the whole backward (the final norm's fp32 input, the chunked loss's input): about
  :data:`GPU_BYTES_PER_TOKEN` per token at Llama-8B's width, a planning figure (the search measures).

Host memory holds the offload states (estimator: 8 bytes per parameter with ``bf16_sr``, 60 GiB for 8B; fp32
states would need 120 GiB and leave nothing) and as many layers' checkpoints as fit in what is left; the
other ``K`` layers' checkpoints stay on the GPU beside the working set. The ceiling is the largest ``S``
for which ``fixed + S x (working + K x 2 d) <= GPU memory`` with
``K = L - floor(host_free / (S x 2 d))``. Torch's caching pinned allocator rounds each checkpoint block up to
a power of two unless told not to (``pinned_max_round_threshold_mb``): rounded, a 2.5 GiB block takes 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

GIB = 2.0**30
PINNED_ROUND_MB = 64
"""Pinned blocks above this many MiB are allocated at their exact size (when torch supports the setting)."""
GPU_BYTES_PER_TOKEN = 176 * 1024
"""Planning figure for the GPU working set per token of Llama-8B (see the Note), scaled by ``d / 4096``: a
recomputed decoder layer saves 85 KiB per token for its backward (measured with saved-tensor hooks on one
bf16 layer of this width, MLP tiled, weights excluded: two fp32 RMSNorm inputs, q/k/v, the rotated q/k,
attention and o_proj inputs), its backward adds ~50 KiB of transients (flash attention's fp32 dq accumulator,
RMSNorm's fp32 gradients), the final norm and the loss keep ~32 KiB through the whole backward, and the
gradient of the residual stream 8 KiB."""
GPU_FIXED_BYTES = 6 * GIB
"""CUDA context, the root unit (embedding and head, bf16: 2 GiB at 8B), gathered and prefetched layers."""
STEP_EFFICIENCY = 0.45
"""Fraction of the peak the executed FLOPs of a long-sequence step reach, for the time estimates only."""


def pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pinned_block(nbytes: int, pow2: bool) -> int:
    """Bytes a pinned block of ``nbytes`` takes in torch's caching host allocator."""
    if pow2 or nbytes <= PINNED_ROUND_MB * 2**20:
        return pow2ceil(nbytes)
    return -(-nbytes // 4096) * 4096


def tiles_for(local_tokens: int, hidden: int) -> int:
    """MLP tiles: ALST's rule, ``ceil(tokens / hidden size)`` (one tile per ``hidden`` tokens)."""
    return max(1, math.ceil(local_tokens / hidden))


def llama_params(dims: dict[str, int]) -> tuple[int, int, int]:
    """(all parameters, one decoder layer's, matmul parameters incl. the untied head) of a Llama shape."""
    d, ff, n = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    kv = dims["num_key_value_heads"] * (d // dims["num_attention_heads"])
    layer_matmul = 2 * d * d + 2 * d * kv + 3 * d * ff
    layer = layer_matmul + 2 * d
    vocab = dims["vocab_size"]
    return n * layer + 2 * vocab * d + d, layer, n * layer_matmul + vocab * d


def flops_per_token(dims: dict[str, int], seq_len: int) -> float:
    """Training FLOPs per token: ``6 x matmul parameters + 12 x layers x hidden x S`` (attention scores and
    values, the PaLM convention the project's other benchmarks use; recomputation not counted)."""
    _, _, matmul = llama_params(dims)
    return 6.0 * matmul + 12.0 * dims["num_hidden_layers"] * dims["hidden_size"] * seq_len


def step_seconds(dims: dict[str, int], seq_len: int, peak_flops: float, efficiency: float = STEP_EFFICIENCY) -> float:
    """A rough step time from the FLOPs executed per token: the matmuls with one more forward (recomputation,
    ``8 x params``) and causal flash attention (forward, recomputed forward, a backward of 2.5 forwards:
    ``9 x layers x hidden x S``), at ``efficiency`` of the peak."""
    _, _, matmul = llama_params(dims)
    attention = 9.0 * dims["num_hidden_layers"] * dims["hidden_size"] * seq_len
    return seq_len * (8.0 * matmul + attention) / (peak_flops * efficiency)


def host_ckpt_bytes_per_layer(dims: dict[str, int], seq_len: int, pow2: bool) -> int:
    """Pinned host bytes of one offloaded layer checkpoint (batch 1)."""
    return pinned_block(2 * dims["hidden_size"] * seq_len, pow2)


def offload_state_bytes(dims: dict[str, int], state_precision: str) -> int:
    """Host bytes of ``zero3_offload``'s parameters, gradients and optimizer states on one GPU (estimator)."""
    from lightning_zero.offload.estimator import Setting, Workload, offload_host_bytes_per_rank
    from lightning_zero.optim.host_states import bytes_per_param

    params, layer, _ = llama_params(dims)
    work = Workload(params, 1, largest_unit=layer, state_bytes=bytes_per_param(state_precision),  # type: ignore[arg-type]
                    master_in_params=state_precision in ("bf16_sr", "bf16_kahan"))
    return int(offload_host_bytes_per_rank(Setting(3, "cpu", "cpu"), work))


@dataclass(frozen=True)
class Fit:
    """One sequence length on one machine, as planned."""

    seq_len: int
    host_layers: int
    """Layers whose checkpoints fit in host memory."""
    gpu_layers: int
    gpu_bytes: float
    fits: bool


def plan(dims: dict[str, int], seq_len: int, host_free: float, gpu_total: float, pow2: bool) -> Fit:
    n = dims["num_hidden_layers"]
    per_layer = host_ckpt_bytes_per_layer(dims, seq_len, pow2)
    host_layers = min(n, max(0, int(host_free // per_layer)))
    keep = n - host_layers
    working = GPU_BYTES_PER_TOKEN * dims["hidden_size"] / 4096
    gpu = GPU_FIXED_BYTES + seq_len * (working + keep * 2 * dims["hidden_size"])
    return Fit(seq_len, host_layers, keep, gpu, gpu <= gpu_total)


def ceiling(dims: dict[str, int], host_free: float, gpu_total: float, pow2: bool, resolution: int = 4096) -> Fit:
    """The largest planned ``S`` (a multiple of ``resolution``) that fits; the search starts there."""
    s = resolution
    best: Optional[Fit] = None
    while s <= 64 * 2**20:
        fit = plan(dims, s, host_free, gpu_total, pow2)
        if fit.fits:
            best = fit
        elif not pow2:  # without rounding the need only grows with S
            break
        s += resolution
    return best or plan(dims, resolution, host_free, gpu_total, pow2)


def absolute_bound(dims: dict[str, int], host_free: float, gpu_total: float) -> int:
    """Tokens whose checkpoints alone would fill the free host memory and the whole GPU: nothing longer can run."""
    return int((max(0.0, host_free) + gpu_total) // (dims["num_hidden_layers"] * 2 * dims["hidden_size"]))


__all__ = ["GIB", "PINNED_ROUND_MB", "Fit", "plan", "ceiling", "absolute_bound", "flops_per_token", "step_seconds",
           "host_ckpt_bytes_per_layer", "offload_state_bytes", "llama_params", "tiles_for", "pinned_block"]
