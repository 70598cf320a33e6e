"""overflow_fast: find the first layer that overflows in fp16/bf16/fp8 training, cheaply."""

from .stats import StatsBatch, tensor_stats

__all__ = ["StatsBatch", "tensor_stats"]
__version__ = "0.1.0"
