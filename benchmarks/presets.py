"""What the benchmarks run, importable without torch: model presets (from ``conf/model/*.yaml``) and
the peer configurations' names, default lists and baselines.

Why not through Hydra: the benchmark parent process must stay light (no torch, no CUDA context on
GPU 0 while the measured children run), and the GPU machine has Hydra only once the wheels are
installed. The YAML files stay the one place the model shapes are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
}
"""Every configuration the peer benchmark knows -> its family ('lightning', 'deepspeed', 'lightning_zero').
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


__all__ = [
    "model_preset", "model_label", "resolve_model", "MODEL_DIR", "ALIASES",
    "PEERS", "DEFAULT_PEERS", "BASELINE", "default_peers", "baseline",
]
