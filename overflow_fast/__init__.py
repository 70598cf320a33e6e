"""overflow_fast: find the first layer that overflows in fp16/bf16/fp8 training, cheaply.

``DebugUnderflowOverflow`` is a drop-in for ``transformers.debug_utils.DebugUnderflowOverflow``;
``tensor_stats`` is the statistics engine under it.
"""

from .debug_option import DebugOption
from .detector import DebugUnderflowOverflow, detect_overflow, get_abs_min_max
from .stats import StatsBatch, tensor_stats

__all__ = [
    "DebugOption",
    "DebugUnderflowOverflow",
    "StatsBatch",
    "detect_overflow",
    "get_abs_min_max",
    "tensor_stats",
]
__version__ = "0.1.0"
