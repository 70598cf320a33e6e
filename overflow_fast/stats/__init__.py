"""The statistics engine: one call computes abs-min, abs-max and special-value counts for a list
of tensors, on their devices. It knows nothing of modules, hooks or text."""

from .batch import StatsBatch
from .dispatch import BACKEND_NAMES, backend_status, tensor_stats, unreadable_reason
from .layout import FIELDS, decode_row

__all__ = [
    "BACKEND_NAMES",
    "FIELDS",
    "StatsBatch",
    "backend_status",
    "decode_row",
    "tensor_stats",
    "unreadable_reason",
]
