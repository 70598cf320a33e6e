"""The portable backend: statistics from stock PyTorch ops, no host sync on accelerators, any device.

It takes several passes per tensor (PyTorch has no fused abs-min/abs-max/count reduction), so
it is the fallback and the twin of the test oracle, not the fast path. On the CPU, where reading
a result waits for nothing, a floating tensor's abs-min and abs-max are read first and only the
counts they leave open are computed: most tensors take abs() and one aminmax, no more passes
than the reference's ``abs().min()``, ``abs().max()``, ``isnan().any()``, ``isinf().any()``.
"""

import struct

import torch

from .._compat import dtypes
from . import kinds
from .layout import NUM_COLUMNS, SMALLEST_NORMAL

NAME = "torch"

_SIGNED_INT_MIN = {
    torch.int8: -(2**7),
    torch.int16: -(2**15),
    torch.int32: -(2**31),
    torch.int64: -(2**63),
}
_UNSIGNED_VIA_INT64 = dtypes("uint16", "uint32")
_UINT64 = (dtypes("uint64") or (None,))[0]
# Exactly representable in float32, e8m0fnu's 2^-127 as a subnormal; its NaN (0xFF) and the fnuz
# formats' (0x80) become float32 NaN.
_FLOAT8 = dtypes("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def unavailable_reason():
    return None


def supports(tensor: torch.Tensor) -> bool:
    return True


def _float_bits(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.float64).view(torch.int64)


def _unsigned_min_max(x: torch.Tensor, sign_bit: int):
    """Min and max of ``x`` read as unsigned integers, returned as int64 holding the uint64 bits.

    Flipping the sign bit maps unsigned order onto signed order, so signed aminmax does the job.
    """
    lo, hi = torch.aminmax(torch.bitwise_xor(x, sign_bit))
    lo = torch.bitwise_xor(lo, sign_bit).to(torch.int64)
    hi = torch.bitwise_xor(hi, sign_bit).to(torch.int64)
    if x.dtype != torch.int64:
        mask = (1 << (x.element_size() * 8)) - 1
        lo, hi = lo & mask, hi & mask
    return lo, hi


_COMPLEX_CHUNK = 1 << 15  # elements per pass of _magnitude


def _exact_square(a: torch.Tensor):
    """a * a = hi + lo exactly (Dekker; one op per kernel, so nothing is fused into an FMA)."""
    hi = a * a
    c = a * 134217729.0  # 2**27 + 1
    a_hi = c - (c - a)
    a_lo = a - a_hi
    lo = ((a_hi * a_hi - hi) + (a_hi * a_lo) * 2.0) + a_lo * a_lo
    return hi, lo


def _magnitude(re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    """sqrt(re**2 + im**2) of float64 parts, as csrc/complex.cpp computes it, op for op (and so
    bit for bit): the sum of squares as an exact double-double, sqrt corrected once by the exact
    residual; parts outside [2**-480, 2**500] scaled by 2**-+600 first, and a subnormal result
    rounded again against the midpoints (torch's abs is one ulp off for some operands)."""
    x, y = re.abs(), im.abs()
    big, small = torch.maximum(x, y), torch.minimum(x, y)
    tiny = big < 2.0**-480
    scale = torch.where(big > 2.0**500, 2.0**-600, torch.where(tiny, 2.0**600, torch.ones_like(big)))
    xs = torch.where(torch.isfinite(big), big, 1.0) * scale
    ys = torch.where(torch.isfinite(big), small, 0.0) * scale
    xx, xx_lo = _exact_square(xs)
    yy, yy_lo = _exact_square(ys)
    s = xx + yy
    b_virtual = s - xx
    s_lo = (xx - (s - b_virtual)) + (yy - b_virtual)
    lo = s_lo + (xx_lo + yy_lo)
    h = torch.sqrt(s + lo)
    hh, hh_lo = _exact_square(h)
    h = h + ((s - hh) + (lo - hh_lo)) / (h * 2.0)
    result = h / scale
    # below 2**-1022 the division rounds h again, to fewer bits: redo that rounding against
    # s + lo by the midpoints around the result (ties to even); no host sync
    scaled = result * 2.0**600
    odd = (result.view(torch.int64) & 1) == 1

    def excess(mid):  # the sign of (s + lo) - mid**2
        mm, mm_lo = _exact_square(mid)
        return (s - mm) + (lo - mm_lo)

    up = excess(scaled + 2.0**-475)
    down = excess(scaled - 2.0**-475)
    go_up = (up > 0) | ((up == 0) & odd)
    go_down = ~go_up & (result > 0) & ((down < 0) | ((down == 0) & odd))
    fixed = torch.where(go_up, torch.nextafter(result, torch.ones_like(result)), result)
    fixed = torch.where(go_down, torch.nextafter(result, torch.zeros_like(result)), fixed)
    result = torch.where(tiny & (h < 2.0**-422), fixed, result)
    m = torch.where(small == 0, big, result)
    m = torch.where(torch.isnan(re) | torch.isnan(im), torch.nan, m)
    return torch.where(torch.isinf(re) | torch.isinf(im), torch.inf, m)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_INF = float("inf")
_pack_double = struct.Struct("<d").pack
_unpack_int64 = struct.Struct("<q").unpack


def _bits(value: float) -> int:
    return _unpack_int64(_pack_double(value))[0]


def _cpu_float_row(x: torch.Tensor):
    """The row of a plain, non-empty real floating CPU tensor as 8 Python ints, with the counts
    that abs-min and abs-max already decide left out; None when abs-max is NaN (the general
    path then counts everything: NaN hides both extremes)."""
    dtype = x.dtype
    if dtype in _FLOAT8:
        x = x.to(torch.float32)  # exact widening; fp8 has few native reductions
    a = x.abs()
    abs_min, abs_max = (v.item() for v in torch.aminmax(a))
    if abs_max != abs_max:
        return None
    numel = x.numel()
    nans = 0
    posinf = neginf = 0
    if abs_max == _INF:  # no NaN (it would have made abs-max NaN), some infinities
        posinf = int(torch.count_nonzero(x == _INF))
        neginf = int(torch.count_nonzero(x == -_INF))
    zeros = subnormal = 0
    tiny = SMALLEST_NORMAL[dtype]
    if abs_min < tiny:  # else every |x| is normal or inf: no zero, no subnormal
        zeros = numel - int(torch.count_nonzero(a)) if abs_min == 0 else 0
        if abs_max > 0:  # all zeros: no subnormal either
            subnormal = int(torch.count_nonzero(a < tiny)) - zeros
    return [_bits(abs_min), _bits(abs_max), nans, posinf, neginf, zeros, subnormal, numel]


def _row(x: torch.Tensor) -> torch.Tensor:
    device = x.device
    zero_count = torch.zeros((), dtype=torch.int64, device=device)
    numel = torch.full((), x.numel(), dtype=torch.int64, device=device)
    if x.numel() == 0:
        return torch.zeros(NUM_COLUMNS, dtype=torch.int64, device=device)
    dtype = x.dtype

    if dtype == torch.bool:
        abs_min = _float_bits(x.all())
        abs_max = _float_bits(x.any())
        zeros = numel - x.sum(dtype=torch.int64)
        return torch.stack([abs_min, abs_max, zero_count, zero_count, zero_count, zeros, zero_count, numel])

    if dtype.is_complex:
        if dtype == torch.complex32:
            x = x.to(torch.complex64)  # exact widening; complex32 has few ops
        # nan and inf by parts, as torch.isnan/isinf (and the reference) count them
        nans = torch.isnan(x).sum()
        posinf = torch.isinf(x).sum()
        # the magnitude in float64 (hypot of the widened parts): a complex64 magnitude never
        # overflows; NaN only when a part is NaN and none is infinite (hypot(inf, nan) = inf)
        # In chunks: _magnitude takes some 60 elementwise ops, which stay in cache this way
        # rather than each allocating and faulting in a full-size float64 temporary.
        parts = torch.view_as_real(x.resolve_conj().resolve_neg().reshape(-1))
        lows, highs, zero_counts, subnormal_counts = [], [], [], []
        for chunk in parts.split(_COMPLEX_CHUNK):
            chunk = chunk.to(torch.float64)
            a = _magnitude(chunk[:, 0], chunk[:, 1])
            low, high = torch.aminmax(a)
            lows.append(low)
            highs.append(high)
            zero_counts.append((a == 0).sum())
            subnormal_counts.append(((a > 0) & (a < SMALLEST_NORMAL[dtype])).sum())
        if len(lows) == 1:
            abs_min, abs_max, zeros, subnormal = lows[0], highs[0], zero_counts[0], subnormal_counts[0]
        else:  # min/max propagate NaN, as aminmax does
            abs_min, abs_max = torch.stack(lows).min(), torch.stack(highs).max()
            zeros, subnormal = torch.stack(zero_counts).sum(), torch.stack(subnormal_counts).sum()
        return torch.stack(
            [_float_bits(abs_min), _float_bits(abs_max), nans, posinf, zero_count, zeros, subnormal, numel]
        )

    if dtype.is_floating_point:
        if dtype in _FLOAT8:
            x = x.to(torch.float32)  # exact widening; fp8 has few native reductions
        a = x.abs()
        abs_min, abs_max = torch.aminmax(a)  # NaN propagates, as in the reference's abs().min()
        nans = torch.isnan(x).sum()
        posinf = (x == float("inf")).sum()
        neginf = (x == float("-inf")).sum()
        zeros = (a == 0).sum()
        subnormal = ((a > 0) & (a < SMALLEST_NORMAL[dtype])).sum()
        return torch.stack(
            [_float_bits(abs_min), _float_bits(abs_max), nans, posinf, neginf, zeros, subnormal, numel]
        )

    zeros = (x == 0).sum()
    if dtype in _SIGNED_INT_MIN:
        # abs() wraps the most negative value onto itself, whose bits read unsigned are its magnitude
        abs_min, abs_max = _unsigned_min_max(x.abs(), _SIGNED_INT_MIN[dtype])
    elif dtype == torch.uint8:
        abs_min, abs_max = (v.to(torch.int64) for v in torch.aminmax(x))
    elif dtype in _UNSIGNED_VIA_INT64:
        abs_min, abs_max = torch.aminmax(x.to(torch.int64))
    elif dtype == _UINT64:
        abs_min, abs_max = _unsigned_min_max(x.view(torch.int64), -(2**63))
    else:
        raise TypeError(f"torch backend: unsupported dtype {dtype}")
    return torch.stack([abs_min, abs_max, zero_count, zero_count, zero_count, zeros, zero_count, numel])


# the device types read on the host here, asked once as the backend loads (a test sets it to take
# the accelerators' path on CPU tensors)
HOST_DEVICE_TYPES = kinds.host_device_types()


def _host_row(x: torch.Tensor):
    """A CPU tensor's row as Python ints where the early-exit path takes it, else None (an
    accelerator's tensor, or a CPU tensor on the accelerators' path: no host read there)."""
    if (x.device.type in HOST_DEVICE_TYPES and type(x) in _PLAIN and x.dtype.is_floating_point
            and x.numel() and x.layout is torch.strided):
        return _cpu_float_row(x)
    return None


def traces(dtype) -> bool:
    """Whether ``_row`` reads ``dtype`` (``traced_rows`` takes it)."""
    return (dtype == torch.bool or dtype in SMALLEST_NORMAL or dtype in _SIGNED_INT_MIN or dtype == torch.uint8
            or dtype in _UNSIGNED_VIA_INT64 or dtype == _UINT64)


def traced_rows(tensors, out=None) -> torch.Tensor:
    """``compute``'s rows while torch.compile traces: every row through ``_row``'s device ops (the
    CPU's early exit reads values on the host, which a graph cannot). Every dtype ``traces``."""
    rows = torch.stack([_row(t.detach()) for t in tensors])
    return rows if out is None else out.copy_(rows)


def compute(tensors, out=None) -> torch.Tensor:
    """Statistics rows, ``[len(tensors), 8]`` int64 on the tensors' (common) device (into ``out``).

    On accelerators every row stays on the device (no sync); CPU floating rows come through
    ``_cpu_float_row``, the others through ``_row``."""
    rows = []
    on_host = True
    for t in tensors:
        t = t.detach()
        row = _host_row(t)
        if row is None:
            on_host = False
            row = _row(t)
        rows.append(row)
    if on_host and rows:
        values = torch.tensor(rows, dtype=torch.int64)
        return values if out is None else out.copy_(values)
    device = next((r.device for r in rows if isinstance(r, torch.Tensor)), None)
    rows = [torch.tensor(r, dtype=torch.int64, device=device) if not isinstance(r, torch.Tensor) else r
            for r in rows]
    return torch.stack(rows, out=out)
