"""overflow_fast: find the first layer that overflows in fp16/bf16/fp8 training, cheaply.

``watch(model)`` attaches the detector with the modern defaults (gradients, keyword inputs, model
outputs, one host sync per forward and per backward); ``DebugUnderflowOverflow`` is a drop-in for
``transformers.debug_utils.DebugUnderflowOverflow``; ``tensor_stats`` is the statistics engine;
``info()`` says what runs here (``overflow-fast info``).
"""

from .debug_option import DebugOption
from .detector import DebugUnderflowOverflow, OverflowDetected, detect_overflow, get_abs_min_max, watch
from .info import info
from .stats import StatsBatch, tensor_stats

__all__ = [
    "DebugOption",
    "DebugUnderflowOverflow",
    "OverflowDetected",
    "StatsBatch",
    "detect_overflow",
    "get_abs_min_max",
    "info",
    "tensor_stats",
    "watch",
]
__version__ = "0.1.0"
