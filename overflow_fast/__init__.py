"""overflow_fast: find the first layer that overflows in fp16/bf16/fp8 training, cheaply.

``watch(model)`` attaches the detector with the modern defaults (gradients, keyword inputs, model
outputs, one host sync per forward and per backward); ``DebugUnderflowOverflow`` is a drop-in for
``transformers.debug_utils.DebugUnderflowOverflow``; ``tensor_stats`` is the statistics engine;
``info()`` says what runs here (``overflow-fast info``).

The names below are imported on first use: ``import overflow_fast`` alone does not import torch, so
the ``overflow-fast report`` command, which only reads JSON, starts fast and small.
"""

import importlib

# eager: it imports nothing heavy, and a lazy name would lose to the submodule of the same name
from ._version import __version__
from .info import info

_EXPORTS = {
    "DebugOption": ".hooks.debug_option",
    "DebugUnderflowOverflow": ".hooks.detector",
    "OverflowDetected": ".hooks.detector",
    "detect_overflow": ".hooks.detector",
    "get_abs_min_max": ".hooks.detector",
    "watch": ".hooks.detector",
    "StatsBatch": ".stats",
    "tensor_stats": ".stats",
}

__all__ = sorted([*_EXPORTS, "info"])


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'overflow_fast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
