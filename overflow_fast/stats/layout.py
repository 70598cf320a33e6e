"""The raw layout of statistics on the device, shared by every backend.

Each tensor's statistics are one row of 8 int64 values, so that a whole batch is a single
``[N, 8]`` int64 tensor that stays on the tensors' device and reaches the host in one copy.

Columns ``ABS_MIN`` and ``ABS_MAX`` hold, for floating, complex and bool tensors, the bit
pattern of a float64 (NaN and inf included); for integer tensors, the magnitude as an
unsigned 64-bit integer stored in int64 bits (|-2**63| = 2**63 does not fit int64 but does fit
uint64). For an empty tensor both hold 0 and the decoded value is ``None``.
"""

import ctypes
import struct

import torch

from .._compat import dtypes

ABS_MIN, ABS_MAX, NAN, POSINF, NEGINF, ZERO, SUBNORMAL, NUMEL = range(8)
NUM_COLUMNS = 8


def host_bytes(tensor):
    """A writable memoryview of the bytes of a contiguous CPU tensor (``struct.pack_into``,
    ``.cast("q")``), without numpy, which torch does not depend on. The tensor must outlive the
    view."""
    array = (ctypes.c_ubyte * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


FIELDS = ("abs_min", "abs_max", "nan", "posinf", "neginf", "zero", "subnormal", "numel")

# Smallest positive normal number per floating dtype: below it (and above 0) a value is subnormal.
SMALLEST_NORMAL = {
    torch.float16: 2.0**-14,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
    torch.float64: 2.0**-1022,
    torch.float8_e4m3fn: 2.0**-6,
    torch.float8_e5m2: 2.0**-14,
    # the AMD formats: fnuz's exponent bias is one more than IEEE's; e8m0fnu's smallest value is
    # 2^-127, a normal one (it has neither zero nor subnormals)
    torch.float8_e4m3fnuz: 2.0**-7,
    torch.float8_e5m2fnuz: 2.0**-15,
    **{dtype: 2.0**-127 for dtype in dtypes("float8_e8m0fnu")},
    # complex dtypes classify their magnitude against the real part's dtype
    torch.complex32: 2.0**-14,
    torch.complex64: 2.0**-126,
    torch.complex128: 2.0**-1022,
}

INTEGER_DTYPES = frozenset(dtypes("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"))


def holds_nonfinite(row) -> bool:
    """Whether a row counts a nan, a +inf or a -inf."""
    return bool(row[NAN] or row[POSINF] or row[NEGINF])


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


# -- combining the rows of a tensor's shards ---------------------------------------------------

_UINT64_MASK = 0xFFFFFFFFFFFFFFFF
_FLOAT_MAGNITUDE_MASK = 0x7FFFFFFFFFFFFFFF
_FLOAT_INF_BITS = 0x7FF0000000000000
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_nan_bits(bits: int) -> bool:
    return (bits & _FLOAT_MAGNITUDE_MASK) > _FLOAT_INF_BITS


def merge_rows(rows, dtype: torch.dtype) -> list:
    """The row of a whole tensor from the rows of its shards (host rows: sequences of 8 ints),
    exactly what ``tensor_stats`` gives for the concatenation of the shards.

    Counts and numel add up; shards with ``numel == 0`` are ignored (an all-empty input gives the
    empty tensor's row, all zeros). abs-min/abs-max are the min/max over the shards:

    - floating, complex and bool rows hold float64 bit patterns of magnitudes (>= 0), whose int64
      order is their float order; a NaN pattern in any shard makes both NaN, as torch's
      ``abs().min()`` / ``max()`` of the whole tensor would be. The NaN pattern decides, not the
      nan count: a complex element ``inf + nan*j`` counts as a nan but its magnitude is inf. (For
      real floating dtypes a nan count > 0 always comes with the NaN pattern.)
    - integer rows hold uint64 magnitudes in int64 bits: compared as unsigned.
    """
    live = [row for row in rows if row[NUMEL] != 0]
    if not live:
        return [0] * NUM_COLUMNS
    merged = [sum(row[column] for row in live) for column in range(NUM_COLUMNS)]
    if is_integer_dtype(dtype):
        low = min(row[ABS_MIN] & _UINT64_MASK for row in live)
        high = max(row[ABS_MAX] & _UINT64_MASK for row in live)
        merged[ABS_MIN] = low - (1 << 64) if low > _INT64_MAX else low
        merged[ABS_MAX] = high - (1 << 64) if high > _INT64_MAX else high
        return merged
    nan = next((bits for row in live for bits in (row[ABS_MIN], row[ABS_MAX]) if _is_nan_bits(bits)), None)
    if nan is not None:
        merged[ABS_MIN] = merged[ABS_MAX] = nan
    else:
        merged[ABS_MIN] = min(row[ABS_MIN] for row in live)
        merged[ABS_MAX] = max(row[ABS_MAX] for row in live)
    return merged


def merge_rows_tensor(rows: torch.Tensor, integer) -> torch.Tensor:
    """:func:`merge_rows` on the device, without a host sync.

    ``rows``: int64 ``[S, 8]`` (the S shards of one tensor) or ``[S, N, 8]`` (N tensors at once);
    ``integer``: a bool, or a bool tensor of shape ``[N]``, True where the rows are of an integer
    dtype. Returns ``[8]`` or ``[N, 8]``. A NaN keeps the largest NaN pattern among the shards
    (the host version keeps the first; the engine's backends write one canonical pattern).
    """
    single = rows.dim() == 2
    if single:
        rows = rows.unsqueeze(1)
    integer = torch.as_tensor(integer, dtype=torch.bool, device=rows.device).reshape(-1)
    live = (rows[..., NUMEL] != 0)  # [S, N]
    merged = (rows * live.unsqueeze(-1)).sum(0)  # counts and numel
    sign = torch.tensor(_INT64_MIN, dtype=torch.int64, device=rows.device)
    # integers: unsigned order is the signed order of the bits with the sign bit flipped
    flip = torch.where(integer, sign, torch.zeros_like(sign))  # [N]
    low = torch.where(live, rows[..., ABS_MIN] ^ flip, _INT64_MAX).amin(0) ^ flip
    high = torch.where(live, rows[..., ABS_MAX] ^ flip, _INT64_MIN).amax(0) ^ flip
    # floats: a NaN pattern in any live shard poisons both
    magnitude = rows[..., ABS_MIN:ABS_MAX + 1] & _FLOAT_MAGNITUDE_MASK  # [S, N, 2]
    is_nan = (magnitude > _FLOAT_INF_BITS) & live.unsqueeze(-1) & ~integer.unsqueeze(-1)
    nan_bits = torch.where(is_nan, rows[..., ABS_MIN:ABS_MAX + 1], _INT64_MIN).amax(-1).amax(0)  # [N]
    poisoned = is_nan.any(-1).any(0)
    any_live = live.any(0)
    merged[:, ABS_MIN] = torch.where(poisoned, nan_bits, torch.where(any_live, low, 0))
    merged[:, ABS_MAX] = torch.where(poisoned, nan_bits, torch.where(any_live, high, 0))
    return merged[0] if single else merged


__all__ += ["merge_rows", "merge_rows_tensor"]
