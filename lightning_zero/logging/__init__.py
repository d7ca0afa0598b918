"""Training metrics for TensorBoard (or any Lightning logger): where time and memory go."""

from lightning_zero.logging.metrics import PEAK_BF16_FLOPS, ZeroMetrics, peak_bf16_flops
from lightning_zero.logging.moe import MoEMetrics

__all__ = ["ZeroMetrics", "MoEMetrics", "PEAK_BF16_FLOPS", "peak_bf16_flops"]
