"""The C++ backend (csrc/, the extension ``overflow_fast._C``): one pass per tensor, many tensors
per call, SIMD and threads.

The extension is optional. When it is missing, fails to load, was built against another torch
or from other sources, ``unavailable_reason()`` says why and dispatch falls back to the torch
backend with one warning; importing this module never raises.
"""

from pathlib import Path

import torch

from .source_hash import source_hash

NAME = "cpu"

# Must equal kAbiVersion in csrc/binding.cpp.
ABI_VERSION = 12

SUPPORTED_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
    torch.complex32, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
})

_REBUILD = "rebuild it with `make setup` (or `pip install --no-build-isolation -e .`)"

try:
    from overflow_fast import _C
    _load_error = None
except Exception as error:  # ImportError, or OSError/undefined symbols from a mismatched torch
    _C = None
    _load_error = f"{type(error).__name__}: {error}"


def _check():
    if _C is None:
        return f"the C++ extension overflow_fast._C could not be loaded ({_load_error}); {_REBUILD}"
    if getattr(_C, "ABI_VERSION", None) != ABI_VERSION:
        return (f"overflow_fast._C has interface version {getattr(_C, 'ABI_VERSION', None)}, "
                f"this package expects {ABI_VERSION}; {_REBUILD}")
    built_with = getattr(_C, "TORCH_VERSION", None)
    if built_with != torch.__version__:
        return f"overflow_fast._C was built against torch {built_with}, not {torch.__version__}; {_REBUILD}"
    # In a source checkout, a module built from older sources is stale.
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    if (csrc / "binding.cpp").is_file() and source_hash(csrc) != getattr(_C, "SOURCE_HASH", None):
        return f"overflow_fast._C is stale: csrc/ changed since it was built; {_REBUILD}"
    return None


_reason = _check()


def unavailable_reason():
    return _reason


def extension():
    """The extension module ``overflow_fast._C``, or None where ``unavailable_reason()`` says why not."""
    return _C if _reason is None else None


def supports(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in SUPPORTED_DTYPES


def compute(tensors, out=None) -> torch.Tensor:
    """Statistics rows, ``[len(tensors), 8]`` int64 on the CPU (into ``out`` if given), in one
    call to the kernel."""
    if _reason is not None:
        raise RuntimeError(f"overflow_fast: the 'cpu' backend is unavailable: {_reason}")
    return _C.compute(tensors if isinstance(tensors, list) else list(tensors), out)
