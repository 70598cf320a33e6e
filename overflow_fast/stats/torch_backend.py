"""The portable backend: statistics from stock PyTorch ops, no host sync, any device.

It takes several passes per tensor (PyTorch has no fused abs-min/abs-max/count reduction), so
it is the fallback and the twin of the test oracle, not the fast path.
"""

import torch

from .layout import NUM_COLUMNS, SMALLEST_NORMAL

NAME = "torch"

_SIGNED_INT_MIN = {
    torch.int8: -(2**7),
    torch.int16: -(2**15),
    torch.int32: -(2**31),
    torch.int64: -(2**63),
}
_UNSIGNED_VIA_INT64 = tuple(getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n))
_UINT64 = getattr(torch, "uint64", None)


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

    if dtype.is_floating_point or dtype.is_complex:
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = x.to(torch.float32)  # exact widening; fp8 has few native reductions
        a = x.abs()
        abs_min, abs_max = torch.aminmax(a)  # NaN propagates, as in the reference's abs().min()
        if dtype.is_complex:
            # complex values are classified by their magnitude
            nans = torch.isnan(a).sum()
            posinf = torch.isinf(a).sum()
            neginf = zero_count
        else:
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


def compute(tensors, out=None) -> torch.Tensor:
    """Statistics rows, ``[len(tensors), 8]`` int64 on the tensors' (common) device (into ``out``)."""
    return torch.stack([_row(t.detach()) for t in tensors], out=out)
