"""Inference under the strategy (issue #31): ZeRO-Inference for evaluation-only runs (engine.py), KV-cached
``generate`` (generate.py, kv_cache.py)."""

from lightning_zero.inference.engine import InferenceEngine, NoOptimizer, build_inference_engine
from lightning_zero.inference.generate import generate
from lightning_zero.inference.kv_cache import HookKVCache

__all__ = ["HookKVCache", "InferenceEngine", "NoOptimizer", "build_inference_engine", "generate"]
