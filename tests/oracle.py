"""An independent float64 / exact-integer reference for tensor_stats, and test-data makers.

It shares nothing with the engine: magnitudes come from Python floats and ints element by
element, and the smallest-normal thresholds are written out again here from the spec table.
Keep inputs small (it walks every element in Python).
"""

import math
from decimal import Decimal, localcontext

import torch

from overflow_fast._compat import dtypes

# AMD's fp8 formats: fnuz (no inf, no -0, NaN is 0x80) and e8m0fnu (a bare exponent)
E8M0 = dtypes("float8_e8m0fnu")  # from torch 2.7: empty on older ones
AMD_FLOAT8 = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) + E8M0
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2) + AMD_FLOAT8
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64) + FLOAT8
COMPLEX_DTYPES = (torch.complex32, torch.complex64, torch.complex128)
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES + INT_DTYPES + (torch.bool,)

_TINY = {
    torch.float16: 2.0**-14,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
    torch.float64: 2.0**-1022,
    torch.float8_e4m3fn: 2.0**-6,
    torch.float8_e5m2: 2.0**-14,
    torch.float8_e4m3fnuz: 2.0**-7,
    torch.float8_e5m2fnuz: 2.0**-15,
    **{dtype: 2.0**-127 for dtype in E8M0},  # its smallest value: no subnormals
    torch.complex32: 2.0**-14,
    torch.complex64: 2.0**-126,
    torch.complex128: 2.0**-1022,
}
_COMPLEX_PART = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The 8-bit float formats from their definitions (OCP 8-bit floating point, AMD's fnuz variants,
# OCP MX's E8M0), not from torch: (exponent bits, mantissa bits, exponent bias, special values).
# "ieee": +-inf and NaN at the all-ones exponent; "fn": no inf, NaN is S.1111.111; "fnuz": no inf,
# no -0, NaN is 0x80; "e8m0": no sign, 2^(byte - 127), NaN is 0xFF.
_FLOAT8_FORMATS = {
    torch.float8_e4m3fn: (4, 3, 7, "fn"),
    torch.float8_e5m2: (5, 2, 15, "ieee"),
    torch.float8_e4m3fnuz: (4, 3, 8, "fnuz"),
    torch.float8_e5m2fnuz: (5, 2, 16, "fnuz"),
    **{dtype: (8, 0, 127, "e8m0") for dtype in E8M0},
}


def take(values, indices):
    """values[indices], through the bytes for the 8-bit floats (torch before 2.8 cannot index them)."""
    if values.element_size() == 1 and values.is_floating_point():
        return values.view(torch.uint8)[indices].view(values.dtype)
    return values[indices]


def float8_value(byte: int, dtype: torch.dtype) -> float:
    """The value of an 8-bit float's bit pattern, decoded from the format's definition."""
    exp_bits, mant_bits, bias, specials = _FLOAT8_FORMATS[dtype]
    if specials == "e8m0":
        return math.nan if byte == 0xFF else math.ldexp(1.0, byte - bias)
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> mant_bits) & ((1 << exp_bits) - 1)
    mantissa = byte & ((1 << mant_bits) - 1)
    if (specials == "fnuz" and byte == 0x80) or (specials == "fn" and (byte & 0x7F) == 0x7F):
        return math.nan
    if specials == "ieee" and exponent == (1 << exp_bits) - 1:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, 1 - bias - mant_bits)
    return sign * math.ldexp((1 << mant_bits) + mantissa, exponent - bias - mant_bits)


_FLOAT8_TABLES = {}  # dtype -> the 256 values of its bytes, decoded by float8_value


def _float8_table(dtype):
    table = _FLOAT8_TABLES.get(dtype)
    if table is None:
        table = _FLOAT8_TABLES[dtype] = [float8_value(byte, dtype) for byte in range(256)]
    return table


def has_inf(dtype: torch.dtype) -> bool:
    """Whether a floating dtype has infinities (the 8-bit fn, fnuz and e8m0 formats do not)."""
    return _FLOAT8_FORMATS.get(dtype, (0, 0, 0, "ieee"))[3] == "ieee"


def hypot(re: float, im: float) -> float:
    """|re + im*j| correctly rounded to float64. math.hypot is, except for subnormal results,
    which it rounds twice (scaled by DBL_MIN); those are redone exactly in decimal."""
    m = math.hypot(re, im)
    if 0.0 < m < 2.0**-1021:
        with localcontext() as context:
            context.prec = 80
            exact = (Decimal(re) * Decimal(re) + Decimal(im) * Decimal(im)).sqrt()
        m = float(exact)  # str -> float: correctly rounded, subnormals included
    return m


def reference_stats(x: torch.Tensor) -> dict:
    """The statistics, element by element in Python floats / ints."""
    dtype = x.dtype
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    if dtype.is_complex:
        # the parts as Python floats (float64 holds every part exactly): the raw bits of each
        # part widened by torch's exact float conversion, with the conj/neg bits resolved first
        parts = flat.resolve_conj().resolve_neg()
        # viewed as its parts only from fresh unit strides (a contiguous one-element or empty tensor
        # may keep any stride, which view() refuses)
        fresh = torch.empty(parts.shape, dtype=dtype).copy_(parts)
        parts = fresh.view(_COMPLEX_PART[dtype]).to(torch.float64).tolist() if numel else []
        pairs = list(zip(parts[0::2], parts[1::2]))
        # nan/inf by parts, as torch.isnan/isinf count them; an inf+nan*j element counts in both
        nan = sum(math.isnan(re) or math.isnan(im) for re, im in pairs)
        posinf = sum(math.isinf(re) or math.isinf(im) for re, im in pairs)
        neginf = 0
        # the magnitude in float64, without overflow for complex32/64 (hypot(inf, nan) is inf);
        # a complex128 magnitude above the float64 range is inf with finite parts
        mags = [hypot(re, im) for re, im in pairs]
    elif dtype.is_floating_point:
        # float64 holds every value of every narrower float dtype exactly
        if dtype in FLOAT8:
            table = _float8_table(dtype)
            values = [table[byte] for byte in flat.view(torch.uint8).tolist()]
        else:
            values = flat.to(torch.float64).tolist()
        mags = [abs(v) for v in values]
        nan = sum(math.isnan(v) for v in values)
        posinf = sum(v == math.inf for v in values)
        neginf = sum(v == -math.inf for v in values)
    else:
        values = [int(v) for v in flat.tolist()]
        mags = [abs(v) for v in values]
        nan = posinf = neginf = 0
    if numel == 0:
        abs_min = abs_max = None
    elif (nan and not dtype.is_complex) or any(isinstance(m, float) and math.isnan(m) for m in mags):
        abs_min = abs_max = math.nan
    else:
        abs_min, abs_max = min(mags), max(mags)
        if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
            abs_min, abs_max = float(abs_min), float(abs_max)
    tiny = _TINY.get(dtype)
    subnormal = sum(0 < m < tiny for m in mags) if tiny is not None else 0
    return {
        "abs_min": abs_min,
        "abs_max": abs_max,
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
        "zero": sum(m == 0 for m in mags),
        "subnormal": subnormal,
        "numel": numel,
    }


def same_stats(got: dict, want: dict) -> bool:
    """Exact equality, NaN equal to NaN, and the value types must agree (int vs float)."""
    if set(got) != set(want):
        return False
    for key, w in want.items():
        g = got[key]
        if isinstance(w, float) and math.isnan(w):
            if not (isinstance(g, float) and math.isnan(g)):
                return False
        elif type(g) is not type(w) or g != w:
            return False
    return True


def assert_stats_equal(got: list, tensors: list, label=""):
    assert len(got) == len(tensors)
    for i, (g, t) in enumerate(zip(got, tensors)):
        want = reference_stats(t)
        assert same_stats(g, want), f"{label} tensor {i} ({t.dtype}, shape {tuple(t.shape)}): got {g}, want {want}"


def random_bits(dtype: torch.dtype, shape, generator=None) -> torch.Tensor:
    """Every bit pattern equally likely: NaNs, infinities, subnormals, zeros of both signs, extremes."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty((), dtype=dtype).element_size()
    if dtype.is_complex:
        real = random_bits(_COMPLEX_PART[dtype], tuple(shape) + (2,), generator)
        return torch.view_as_complex(real.contiguous())
    ints = torch.randint(-(2**62), 2**62, tuple(shape), generator=generator, dtype=torch.int64)
    ints = ints ^ (torch.randint(0, 2, tuple(shape), generator=generator, dtype=torch.int64) << 63)
    raw = ints.to(_SAME_WIDTH_INT[size]) if size < 8 else ints
    if size == 1:
        raw = (ints & 0xFF).to(torch.uint8)
    return raw.view(dtype) if dtype != raw.dtype else raw


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """The values each dtype can get wrong: NaN, ±inf, ±0, subnormals, the smallest normal, max finite."""
    if dtype == torch.bool:
        return torch.tensor([True, False, True])
    if dtype.is_floating_point or dtype.is_complex:
        base = _COMPLEX_PART.get(dtype, dtype)
        info = torch.finfo(base)
        values = [0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, -info.tiny]
        if info.smallest_normal > 0 and base not in FLOAT8:
            values += [info.tiny / 2, -info.tiny / 4]
        values += [math.nan, math.inf, -math.inf]
        if dtype.is_complex:
            reals = torch.tensor(values, dtype=base)
            # every (re, im) pair of the values above: max+max*j overflows a naive |z| in the
            # part's precision, inf+nan*j counts as a nan and an inf with magnitude inf, ...
            re = reals.repeat_interleave(len(values))
            im = reals.repeat(len(values))
            return torch.view_as_complex(torch.stack([re, im], dim=-1).contiguous())
        if dtype == torch.float8_e4m3fn:
            # no infinities: build from raw bytes (0x7F is NaN, 0x7E max finite, 0x01 min subnormal)
            return torch.tensor([0x00, 0x80, 0x38, 0xB8, 0x7E, 0xFE, 0x08, 0x88, 0x01, 0x87, 0x7F, 0xFF],
                                dtype=torch.uint8).view(dtype)
        if dtype == torch.float8_e5m2:
            # 0x7C +inf, 0xFC -inf, 0x7E NaN, 0x7B max finite, 0x04 smallest normal, 0x01 min subnormal
            return torch.tensor([0x00, 0x80, 0x3C, 0xBC, 0x7B, 0xFB, 0x04, 0x84, 0x01, 0x83, 0x7C, 0xFC, 0x7E],
                                dtype=torch.uint8).view(dtype)
        if dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            # no inf, no -0: 0x80 NaN, 0x40 1.0, 0x7F max finite, smallest normal (e4m3fnuz 0x08,
            # e5m2fnuz 0x04), 0x01 min subnormal, 0x03 a larger one
            normal = 0x08 if dtype == torch.float8_e4m3fnuz else 0x04
            return torch.tensor([0x00, 0x40, 0xC0, 0x7F, 0xFF, normal, normal | 0x80, 0x01, 0x83, 0x03, 0x80],
                                dtype=torch.uint8).view(dtype)
        if dtype in E8M0:
            # no sign, zero or subnormal: 0x00 2^-127, 0x7F 1.0, 0xFE 2^127, 0xFF NaN
            return torch.tensor([0x00, 0x7F, 0x80, 0x01, 0xFE, 0xFF], dtype=torch.uint8).view(dtype)
        return torch.tensor(values, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([0, 1, info.max, info.min, info.min + 1 if info.min else 2, 7], dtype=dtype)
