"""Inference under the strategy (issue #31): ZeRO-Inference for evaluation-only runs (engine.py), KV-cached
``generate`` (generate.py, kv_cache.py; with ``compile``: a static cache and a compiled step, compiled.py,
static_cache.py), weight-only int8/int4 Linear quantization (quant.py), MoQ
quantization-aware training and export (moq.py)."""

from lightning_zero.config.decode import DecodeConfig
from lightning_zero.inference.compiled import CompiledDecoder
from lightning_zero.inference.engine import InferenceEngine, NoOptimizer, build_inference_engine
from lightning_zero.inference.generate import generate
from lightning_zero.inference.kv_cache import HookKVCache
from lightning_zero.inference.moq import MoQ, export_quantized, fake_quantize
from lightning_zero.inference.quant import QuantLinear, quantize_linears, quantize_weight, register_kernel

__all__ = ["CompiledDecoder", "DecodeConfig", "HookKVCache", "InferenceEngine", "MoQ", "NoOptimizer", "QuantLinear",
           "build_inference_engine", "export_quantized", "fake_quantize", "generate", "quantize_linears",
           "quantize_weight", "register_kernel"]
