"""What the benchmarks run, importable without torch: model presets (from ``conf/model/*.yaml``) and
the peer configurations' names, default lists and baselines.

Why not through Hydra: the benchmark parent process must stay light (no torch, no CUDA context on
GPU 0 while the measured children run), and the GPU machine has Hydra only once the wheels are
installed. The YAML files stay the one place the model shapes are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"

ALIASES = {"tiny": "gpt_tiny", "small": "gpt_small", "1b": "gpt_1b", "1.3b": "gpt_1b"}
"""Short names accepted by ``--model``."""


def resolve_model(name: str) -> Path:
    """A preset name (``gpt_1b``, ``tiny``, ...) or a YAML path -> the YAML file."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    stem = ALIASES.get(name, name)
    path = MODEL_DIR / f"{stem}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_DIR.glob("*.yaml")) + sorted(ALIASES)
        raise ValueError(f"Unknown model {name!r}; valid choices are {known} or a path to a YAML file.")
    return path


def _parse_flat_yaml(text: str) -> dict[str, Any]:
    """``key: scalar`` lines (all the model presets contain), for machines without PyYAML."""
    out: dict[str, Any] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, value = line.partition(":")
        value = value.strip()
        low = value.lower()
        parsed: Any
        if low in ("true", "false"):
            parsed = low == "true"
        else:
            try:
                parsed = int(value)
            except ValueError:
                try:
                    parsed = float(value)
                except ValueError:
                    parsed = value
        out[key.strip()] = parsed
    return out


def model_preset(name: str) -> dict[str, Any]:
    """The preset's fields (GPTConfig keyword arguments)."""
    text = resolve_model(name).read_text()
    try:
        import yaml
    except ImportError:
        return _parse_flat_yaml(text)
    return dict(yaml.safe_load(text))


def model_label(name: str) -> str:
    """The preset's file stem, for table headers (``tiny`` -> ``gpt_tiny``)."""
    return resolve_model(name).stem




PEERS: dict[str, str] = {
    "single": "lightning",
    "ddp": "lightning",
    "fsdp": "lightning",
    "deepspeed_stage_2": "deepspeed",
    "deepspeed_stage_3": "deepspeed",
    "zero0": "lightning_zero",
    "zero1": "lightning_zero",
    "zero2": "lightning_zero",
    "zero3": "lightning_zero",
    "zero2_bf16sr": "lightning_zero",
    "zero3_bf16sr": "lightning_zero",
    "zero3_bf16sr_g16": "lightning_zero",
    "zero3_bf16kahan": "lightning_zero",
    "zero3_fp8": "lightning_zero",
    "zero3_fp8_rowwise": "lightning_zero",
    "zero3_fp8_head": "lightning_zero",
    "zero2_autocast": "lightning_zero",
    "zero3_autocast": "lightning_zero",
}
"""Every configuration the peer benchmark knows (``*_bf16sr``/``*_bf16kahan``: 16-bit device states,
zero/states16.py; ``_g16``: bf16 gradient shards; ``*_fp8``: fp8 linears through torchao, tensorwise or
rowwise scaling, config/fp8.py; ``*_autocast``: ``mixed_precision="autocast"``, ddp's bf16-mixed layout over fp32
weights, config/mixed.py; run with ``--configs``, not by default) -> its family ('lightning', 'deepspeed', 'lightning_zero').
``peers_worker.CONFIGS`` says how each is built."""

DEFAULT_PEERS: dict[int, list[str]] = {
    1: ["single", "zero1", "zero2", "zero3", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"],
    2: ["ddp", "zero1", "zero2", "zero3", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"],
}
"""What ``peers.py --gpus N`` runs without ``--configs``, in this order (N > 2 uses the 2-GPU list).
The baseline first, then ours, then the peers: if a time budget runs out, DeepSpeed (the slowest to
start) is what gets skipped."""

BASELINE: dict[int, str] = {1: "single", 2: "ddp"}
"""The configuration every other row's tokens/s is divided by (N > 2: ddp)."""


def default_peers(gpus: int) -> list[str]:
    """The configurations ``peers.py --gpus N`` runs by default."""
    return list(DEFAULT_PEERS[1 if gpus == 1 else 2])


def baseline(gpus: int) -> str:
    """The configuration the table's ratio column divides by."""
    return BASELINE[1 if gpus == 1 else 2]


# ---------------------------------------------------------------------------------------------------- LoRA benchmark

LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "llama_8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "seq_len": 2048,
    },
    "llama_70b": {
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "seq_len": 2048,
    },
    "llama_tiny": {
        "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "seq_len": 256,
    },
}
"""Llama-style shapes of ``benchmarks/lora.py`` (``transformers.LlamaConfig`` fields, untied head, plus the
sequence length trained on). ``llama_8b`` is Llama-3-8B's shape (8.03 G parameters), ``llama_70b`` Llama-3-70B's
(70.6 G: issue #31's ZeRO-Inference figure); ``llama_tiny`` is a
CPU smoke-test model. Random weights: nothing is downloaded."""

LLAMA_ALIASES = {"8b": "llama_8b", "70b": "llama_70b", "tiny": "llama_tiny"}
"""Short names accepted by ``lora.py --model``."""

LORA: dict[str, Any] = {
    "r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
    "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
"""``peft.LoraConfig`` of the LoRA benchmark: rank 16 on every attention and MLP projection."""

LORA_PEERS: dict[str, str] = {
    "zero3": "lightning_zero",
    "fsdp": "lightning",
    "fsdp_mixed": "lightning",
    "deepspeed_stage_3": "deepspeed",
    "fsdp_peft": "lightning",
    "ddp": "lightning",
}
"""Configurations of ``lora.py`` -> family (as :data:`PEERS`), in the default order: ours, the two FSDP
variants of Lightning's fine-tuning setup, DeepSpeed, then the extras (FSDP wrapped by peft's own policy,
and ``ddp`` as a reference row), which the time budget cuts first. ``lora_worker.CONFIGS`` says how each
is built."""

LORA_PRECISION: dict[str, str] = {
    "zero3": "bf16-mixed",
    "fsdp": "bf16-true",
    "fsdp_mixed": "bf16-mixed",
    "deepspeed_stage_3": "bf16-mixed",
    "fsdp_peft": "bf16-true",
    "ddp": "bf16-true",
}
"""Lightning ``precision`` of each LoRA configuration."""

LORA_BASELINE = "fsdp"
"""The configuration the LoRA table's ratio column divides by when no FSDP variant ran (otherwise the
fastest FSDP variant, "the fsdp peer")."""

LORA_FSDP_VARIANTS = ("fsdp", "fsdp_mixed", "fsdp_peft")
"""The FSDP configurations of the LoRA benchmark: the fastest that ran is "the fsdp peer"."""


def llama_preset(name: str, layers: Optional[int] = None, seq_len: Optional[int] = None) -> tuple[str, dict[str, int]]:
    """(preset name, its fields) with the depth and sequence length overridden where given."""
    key = LLAMA_ALIASES.get(name, name)
    if key not in LLAMA_PRESETS:
        raise ValueError(f"Unknown Llama preset {name!r}; valid choices are {sorted(LLAMA_PRESETS) + sorted(LLAMA_ALIASES)}.")
    dims = dict(LLAMA_PRESETS[key])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    if seq_len is not None:
        dims["seq_len"] = seq_len
    return key, dims


def llama_lora_counts(dims: dict[str, int], lora: Optional[dict[str, Any]] = None) -> dict[str, float]:
    """Parameters (total, LoRA-trainable, frozen matmul) and training FLOPs per token of a LoRA'd Llama.

    FLOPs: the frozen matmuls cost 4 per parameter and token (forward, and the input gradient in
    backward; their weight gradient is not needed), the LoRA matmuls 6, attention scores and values
    12 * layers * hidden * seq (as ``examples/gpt.py``'s ``flops_per_token``). Recomputation under
    activation checkpointing, and weight gradients a strategy computes for frozen weights anyway, are
    not counted: MFU measures useful work.
    """
    lora = LORA if lora is None else lora
    d, ff, n_layer = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    kv = dims["num_key_value_heads"] * (d // dims["num_attention_heads"])
    vocab, r = dims["vocab_size"], int(lora["r"])
    shapes = {  # (in, out) of every projection LoRA may target
        "q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
        "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d),
    }
    layer_matmul = sum(i * o for i, o in shapes.values())
    layer_lora = sum(r * (i + o) for name, (i, o) in shapes.items() if name in lora["target_modules"])
    frozen_matmul = n_layer * layer_matmul + vocab * d  # + the untied LM head
    frozen = frozen_matmul + vocab * d + n_layer * 2 * d + d  # + embedding and RMSNorm weights
    trainable = n_layer * layer_lora
    attention = 12.0 * n_layer * d * dims["seq_len"]
    return {
        "total": float(frozen + trainable),
        "trainable": float(trainable),
        "frozen_matmul": float(frozen_matmul),
        "flops_per_token": 4.0 * frozen_matmul + 6.0 * trainable + attention,
    }


__all__ = [
    "model_preset", "model_label", "resolve_model", "MODEL_DIR", "ALIASES",
    "PEERS", "DEFAULT_PEERS", "BASELINE", "default_peers", "baseline",
    "LLAMA_PRESETS", "LLAMA_ALIASES", "LORA", "LORA_PEERS", "LORA_PRECISION", "LORA_BASELINE", "LORA_FSDP_VARIANTS",
    "llama_preset", "llama_lora_counts",
]
