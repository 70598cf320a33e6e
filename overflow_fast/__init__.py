"""overflow_fast: find the first layer that overflows in fp16/bf16/fp8 training, cheaply.

``watch(model)`` attaches the detector with the modern defaults (gradients, keyword inputs, model
outputs, one host sync per forward and per backward); ``DebugUnderflowOverflow`` is a drop-in for
``transformers.debug_utils.DebugUnderflowOverflow``; ``tensor_stats`` is the statistics engine.

The names below are imported on first use: ``import overflow_fast`` alone does not import torch, so
the ``overflow-fast report`` command, which only reads JSON, starts fast and small.
"""

import importlib
import sys

_EXPORTS = {
    "DebugOption": ".debug_option",
    "DebugUnderflowOverflow": ".detector",
    "OverflowDetected": ".detector",
    "detect_overflow": ".detector",
    "get_abs_min_max": ".detector",
    "watch": ".detector",
    "StatsBatch": ".stats",
    "tensor_stats": ".stats",
}

__all__ = [
    "DebugOption",
    "DebugUnderflowOverflow",
    "OverflowDetected",
    "StatsBatch",
    "detect_overflow",
    "get_abs_min_max",
    "tensor_stats",
    "watch",
]
__version__ = "0.1.0"


class _TorchBeforeExtension:
    """The compiled extension links against torch's libraries, which are found once torch is
    imported: `import overflow_fast._C` imports torch first, as the eager package import did."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname == __name__ + "._C":
            import torch  # noqa: F401
        return None  # the usual finders load it


if not any(getattr(finder, "__name__", None) == "_TorchBeforeExtension" for finder in sys.meta_path):
    sys.meta_path.insert(0, _TorchBeforeExtension)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'overflow_fast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
