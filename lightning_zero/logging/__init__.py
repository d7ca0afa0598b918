"""Training metrics for TensorBoard (or any Lightning logger): where time and memory go."""

from lightning_zero.logging.metrics import PEAK_BF16_FLOPS, ZeroMetrics, peak_bf16_flops

__all__ = ["ZeroMetrics", "PEAK_BF16_FLOPS", "peak_bf16_flops"]
