"""Low-precision pieces (issue #33): block-quantized int8/int4 tensors for ZeRO++'s quantized weight
all-gather (qwZ) and gradient reduce-scatter (qgZ), each with its pure-torch definition and tests; fp8.py,
the FP8 linears (torchao's, imported only when ``fp8=...`` is asked for)."""

from lightning_zero.quant.blocks import QuantizedBlocks, dequantize, quantize

__all__ = ["QuantizedBlocks", "dequantize", "quantize"]
