"""The C++ backend (csrc/, the extension ``overflow_fast._C``): one pass per tensor, many tensors
per call, SIMD and threads.

The extension comes from ``cpu_build``: a prebuilt copy when one matches this environment, else a
build for this torch and this CPU made on first use and cached. ``extension()`` and
``unavailable_reason()`` are the entry points; the first call of either loads (or builds) it.
When it cannot be had, ``unavailable_reason()`` says why and what to do, one warning says so, and
dispatch falls back to the torch backend; importing this module never raises, and never builds.
"""

import threading
import warnings

import torch

from .._compat import dtypes
from . import cpu_build
from .kinds import PLAIN_TYPES, is_zero3_released

NAME = "cpu"

# Must equal kAbiVersion in csrc/binding.cpp.
ABI_VERSION = 23

SUPPORTED_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    *dtypes("float8_e8m0fnu"),
    torch.complex32, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
})

_lock = threading.Lock()
_state = None  # (module or None, reason or None, details), once loaded
_compute = None  # the module's compute, once it loaded and passed the checks


def _check(module):
    if getattr(module, "ABI_VERSION", None) != ABI_VERSION:
        return (f"the C++ kernel at {module.__file__} has interface version "
                f"{getattr(module, 'ABI_VERSION', None)}, this package expects {ABI_VERSION}; delete "
                "it to rebuild")
    built_with = getattr(module, "TORCH_VERSION", None)
    if built_with != torch.__version__:
        return (f"the C++ kernel at {module.__file__} was built against torch {built_with}, not "
                f"{torch.__version__}; delete it to rebuild")
    return None


def _fallback_message(reason):
    """The one warning: why, where its cost is measured (the figures live there, not here), and
    the fix for how the package was installed, unless the reason has it."""
    fix = cpu_build._fix_hint()
    return (f"overflow_fast: the 'cpu' backend is unavailable ({reason}); falling back to the slower "
            "'torch' backend: same numbers, but a watch() or DebugUnderflowOverflow training step "
            "costs more overhead than with the kernel (measured in benchmarks/RESULTS.md, "
            "'Without a C++ compiler')"
            + ("" if fix in reason else f"; to have the kernel, {fix}"))


def _ensure():
    global _state, _compute
    if _state is None:
        with _lock:
            if _state is None:
                module, reason, details = cpu_build.load()
                if module is not None and reason is None:
                    reason = _check(module)
                if reason is None:
                    _compute = module.compute
                    module.set_zero3_released(is_zero3_released)  # (its one owner: the launchers ask it)
                else:
                    # Warned here, once, whoever asked first: the rows launcher's callers and the
                    # Triton table lose their C++ loops too, not only dispatch's CPU tensors.
                    warnings.warn(_fallback_message(reason), RuntimeWarning, stacklevel=3)
                _state = (module, reason, details)
    return _state


def __getattr__(name):
    # _C: the extension module (None where it could not be loaded), loaded on first access
    if name == "_C":
        return _ensure()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unavailable_reason():
    return _ensure()[1]


def warned():
    """Whether loading already warned that this backend is unavailable (dispatch does not repeat it)."""
    return _state is not None and _state[1] is not None


def details():
    """Where the extension comes from: ``cpu_build.load``'s details (isa, origin, path, key, ...)."""
    return _ensure()[2]


def extension():
    """The extension module ``overflow_fast._C``, or None where ``unavailable_reason()`` says why not."""
    module, reason, _ = _ensure()
    return module if reason is None else None


# The rows launcher's format words: any code below 32 per dtype does (the launcher maps a code
# back to its dtype); the order is fixed so that a word always means the same dtype.
_WORDS = {dtype: code for code, dtype in enumerate(sorted(SUPPORTED_DTYPES, key=str))}
_launcher = None


def launcher():
    """The C++ ``Launcher`` of the CPU (its "cpu" driver: this kernel on the packed arguments), which
    a caller binds (``dispatch.rows_launcher``) to read CPU tensors within its own C++ call; None
    without the extension."""
    global _launcher
    module = extension()
    if module is None:
        return None
    if _launcher is None or _launcher[0] is not module:
        # no chunks (one "program" a tensor), no format groups (nothing compiled), no accumulators,
        # no Triton and no fallback launch
        made = module.Launcher("cpu", torch.device("cpu"), tuple(PLAIN_TYPES), _WORDS, 32, 1 << 62, 4, 32,
                               torch.empty(0, 8, dtype=torch.int64), 1, None, None, True, None)
        _launcher = (module, made)
    return _launcher[1]


def supports(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in SUPPORTED_DTYPES


def compute(tensors, out=None) -> torch.Tensor:
    """Statistics rows, ``[len(tensors), 8]`` int64 on the CPU (into ``out`` if given), in one
    call to the kernel."""
    if _compute is None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"overflow_fast: the 'cpu' backend is unavailable: {reason}")
    return _compute(tensors if isinstance(tensors, list) else list(tensors), out)
