"""The raw layout of statistics on the device, shared by every backend.

Each tensor's statistics are one row of 8 int64 values, so that a whole batch is a single
``[N, 8]`` int64 tensor that stays on the tensors' device and reaches the host in one copy.

Columns ``ABS_MIN`` and ``ABS_MAX`` hold, for floating, complex and bool tensors, the bit
pattern of a float64 (NaN and inf included); for integer tensors, the magnitude as an
unsigned 64-bit integer stored in int64 bits (|-2**63| = 2**63 does not fit int64 but does fit
uint64). For an empty tensor both hold 0 and the decoded value is ``None``.
"""

import struct

import torch

ABS_MIN, ABS_MAX, NAN, POSINF, NEGINF, ZERO, SUBNORMAL, NUMEL = range(8)
NUM_COLUMNS = 8

FIELDS = ("abs_min", "abs_max", "nan", "posinf", "neginf", "zero", "subnormal", "numel")

# Smallest positive normal number per floating dtype: below it (and above 0) a value is subnormal.
SMALLEST_NORMAL = {
    torch.float16: 2.0**-14,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
    torch.float64: 2.0**-1022,
    torch.float8_e4m3fn: 2.0**-6,
    torch.float8_e5m2: 2.0**-14,
    # complex dtypes classify their magnitude against the real part's dtype
    torch.complex32: 2.0**-14,
    torch.complex64: 2.0**-126,
    torch.complex128: 2.0**-1022,
}

INTEGER_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return dtype in INTEGER_DTYPES


def _float_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def decode_row(row, dtype: torch.dtype) -> dict:
    """Turn one host row (a sequence of 8 Python ints) into the public dict of statistics."""
    numel = row[NUMEL]
    if numel == 0:
        abs_min = abs_max = None
    elif is_integer_dtype(dtype):
        abs_min = row[ABS_MIN] & 0xFFFFFFFFFFFFFFFF
        abs_max = row[ABS_MAX] & 0xFFFFFFFFFFFFFFFF
    else:
        abs_min = _float_from_bits(row[ABS_MIN])
        abs_max = _float_from_bits(row[ABS_MAX])
    return {
        "abs_min": abs_min,
        "abs_max": abs_max,
        "nan": row[NAN],
        "posinf": row[POSINF],
        "neginf": row[NEGINF],
        "zero": row[ZERO],
        "subnormal": row[SUBNORMAL],
        "numel": numel,
    }


__all__ = [
    "ABS_MIN", "ABS_MAX", "NAN", "POSINF", "NEGINF", "ZERO", "SUBNORMAL", "NUMEL",
    "NUM_COLUMNS", "FIELDS", "SMALLEST_NORMAL", "INTEGER_DTYPES", "is_integer_dtype",
    "decode_row",
]
