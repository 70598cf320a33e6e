"""What every part of the Triton backend shares: Triton's import and the interpreter switch, the
launch shape, the formats the kernels read and their format words, and the extension
(``overflow_fast._C``: the table's C++ loop and the list read's launcher), loaded on first use.

The files of the backend, one concern each (``triton_backend`` is their face), each importing only
those before it: triton_common (this), triton_kernels (the kernels), triton_table (the table
kernels' path and its pinned staging), triton_launch (the list kernel's launch through the C++
launcher), triton_devices (the list read's state on each device), triton_list (the list read: a
call's tensors passed by value, and its first use on a device).
"""

import os

import torch

from .. import _compat
from . import cpu_backend
from .kinds import PLAIN_TYPES

# The extension (the table in one C++ loop, csrc/table.cpp, and the C++ launcher) is loaded, and
# built if need be, on first use, never at import: _extension() and _triton_table() (None where it
# is unavailable: the Python _table then). Both are module globals once loaded, so a test or a
# benchmark may set them.
_UNLOADED = object()


def _load_extension(name):
    value = globals().get(name, _UNLOADED)
    if value is _UNLOADED:
        extension = cpu_backend.extension()
        globals().setdefault("_EXTENSION", extension)
        globals().setdefault("_TRITON_TABLE", extension.triton_table if extension is not None else None)
        value = globals()[name]
    return value


def _extension():
    return _load_extension("_EXTENSION")


def _triton_table():
    return _load_extension("_TRITON_TABLE")


def __getattr__(name):
    if name in ("_EXTENSION", "_TRITON_TABLE"):
        return _load_extension(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Exact types the C++ loop reads (subclasses take the Python path).
_PLAIN_TYPES = tuple(PLAIN_TYPES)
_functorch_interpreter = torch._C._functorch.peek_interpreter_stack  # None outside vmap/grad

try:
    import triton
    import triton.language as tl
except Exception as error:  # Triton is optional: the package must import without it
    triton = tl = None
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"
else:
    _IMPORT_ERROR = None

# The interpreter is chosen when triton.jit decorates a kernel, i.e. at import of this module.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if _INTERPRET:
    _compat.interpreter_indexes_one_element_arrays()

# Element kinds.
_FLOAT, _SIGNED, _UNSIGNED, _BOOL = 0, 1, 2, 3

# The special values of a float format, which decide how its bits are classified:
# _IEEE: +-inf at the all-ones exponent, NaN above; _FN (float8_e4m3fn): no inf, NaN is the
# all-ones magnitude; _FNUZ (float8_e4m3fnuz, float8_e5m2fnuz): no inf, no -0, the one NaN is the
# sign bit alone, and the exponent bias is one more than IEEE's; _E8M0 (float8_e8m0fnu): no sign,
# no zero, no subnormal, no inf: the byte is an exponent (2^(x-127)), all ones NaN.
_IEEE, _FN, _FNUZ, _E8M0 = 0, 1, 2, 3

# Launch shape. A chunk is BLOCK_SIZE * BLOCKS_PER_CHUNK elements of one tensor: large enough that
# the partials are a tiny fraction of the traffic, small enough that a 256 MB tensor gives
# thousands of programs. BLOCKS_PER_CHUNK <= 31 because the per-lane counters are 5-bit fields.
BLOCK_SIZE = 4096
BLOCKS_PER_CHUNK = 16
NUM_WARPS = 8
COMBINE_BLOCK = 128
# The partials kernel holds the loop of every format present, and the compiler gives it the
# registers of the widest one: on sm90, 91 per thread for bf16 alone but ~140 once an int64 tensor
# (input_ids) is in the launch, one program of 8 warps per SM instead of two for the bf16 loop that
# moves most of the bytes. 128 keeps two, without spills (cuobjdump of every format for sm90:
# LOCAL:0). A CUDA option (HIP's Triton rejects it; the interpreter ignores it).
MAX_REGISTERS = 128
# The formats one compiled variant of a kernel holds at most: a launch whose tensors have more is
# made once per group of them (a program whose tensor's format is not in its launch's group does
# nothing), so that a first use never waits for one variant holding every loop
# (benchmarks/bench_triton_compile.py: what a variant costs by its formats).
MAX_FORMATS = 4


def format_groups(formats, unaligned=0, max_formats=MAX_FORMATS):
    """The launches of a call whose tensors' format codes are the bits of ``formats`` (those of a
    tensor starting unaligned: of ``unaligned``): [(FORMATS, ANY_UNALIGNED)], at most
    ``max_formats`` formats each, in code order (the C++ launcher groups them the same way)."""
    codes = [code for code in range(formats.bit_length()) if formats >> code & 1]
    groups = []
    for begin in range(0, len(codes), max_formats):
        group = sum(1 << code for code in codes[begin:begin + max_formats])
        groups.append((group, bool(unaligned & group)))
    return groups
_REGISTER_CAP = {"maxnreg": MAX_REGISTERS} if getattr(torch.version, "hip", None) is None else {}

# The formats the kernels read, in the order of their codes; ``_stats_partials_kernel`` has one
# branch per code, in the same order. (dtype name, kind, exponent bits, mantissa bits, specials)
_FORMATS = (
    ("float64", _FLOAT, 11, 52, _IEEE),
    ("float32", _FLOAT, 8, 23, _IEEE),
    ("float16", _FLOAT, 5, 10, _IEEE),
    ("bfloat16", _FLOAT, 8, 7, _IEEE),
    ("float8_e4m3fn", _FLOAT, 4, 3, _FN),  # no inf; NaN is S.1111.111
    ("float8_e5m2", _FLOAT, 5, 2, _IEEE),
    ("uint8", _UNSIGNED, 0, 0, _IEEE),
    ("int8", _SIGNED, 0, 0, _IEEE),
    ("int16", _SIGNED, 0, 0, _IEEE),
    ("int32", _SIGNED, 0, 0, _IEEE),
    ("int64", _SIGNED, 0, 0, _IEEE),
    ("bool", _BOOL, 0, 0, _IEEE),  # torch stores bool as one byte holding 0 or 1
    ("uint16", _UNSIGNED, 0, 0, _IEEE),  # uint16/32/64: when this torch has them
    ("uint32", _UNSIGNED, 0, 0, _IEEE),
    ("uint64", _UNSIGNED, 0, 0, _IEEE),
    ("float8_e4m3fnuz", _FLOAT, 4, 3, _FNUZ),  # NaN is 0x80
    ("float8_e5m2fnuz", _FLOAT, 5, 2, _FNUZ),
    ("float8_e8m0fnu", _FLOAT, 8, 0, _E8M0),  # NaN is 0xFF
)

# The format word of a tensor (int64): bits 0-4 the format code, bit 5 set when the data starts on
# a 16-byte boundary, then the format's parameters for the combine kernel: bits 6-7 kind, bit 8
# flip (64-bit integers: unsigned order through a sign-bit flip), bits 9-10 specials, bits 11-14
# exponent bits, bits 15-20 mantissa bits. The C++ table (table.cpp) takes the code as the bits
# below _ALIGNED_BIT.
_ALIGNED_BIT = 1 << 5
_CODE_MASK = _ALIGNED_BIT - 1


def _format_word(code, dtype, kind, exp_bits, mant_bits, specials):
    flip = kind != _FLOAT and dtype.itemsize == 8
    return code | kind << 6 | flip << 8 | specials << 9 | exp_bits << 11 | mant_bits << 15


assert len(_FORMATS) <= _CODE_MASK + 1
_FORMAT_WORD = {}  # dtype -> its format word, alignment bit clear
for _code, (_name, _kind, _exp, _mant, _specials) in enumerate(_FORMATS):
    if hasattr(torch, _name):
        _dtype = getattr(torch, _name)
        _FORMAT_WORD[_dtype] = _format_word(_code, _dtype, _kind, _exp, _mant, _specials)

# The dtypes the kernels read (as the other backends' SUPPORTED_DTYPES).
SUPPORTED_DTYPES = frozenset(_FORMAT_WORD) if triton is not None else frozenset()


def unavailable_reason():
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if _INTERPRET or torch.cuda.is_available():
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 was not set before overflow_fast loaded the backend"


def supports(tensor: torch.Tensor) -> bool:
    # The interpreter reads the pointer table as host addresses, so it takes CPU tensors only;
    # compiled kernels take CUDA tensors only.
    device_ok = tensor.device.type == ("cpu" if _INTERPRET else "cuda")
    return device_ok and tensor.dtype in SUPPORTED_DTYPES and tensor.layout == torch.strided

