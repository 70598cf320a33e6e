"""AMD's 8-bit floats: float8_e4m3fnuz and float8_e5m2fnuz (no inf, no -0, NaN is 0x80) and
float8_e8m0fnu (a bare exponent 2^(byte - 127): no sign, no zero, no subnormal, NaN is 0xFF).

The oracle decodes every byte from the formats' definitions; here it is checked against torch's own
conversion and torch.finfo, the torch backend is checked byte by byte against it, the dispatch
layer must take these dtypes, and the detector must report a NaN in them. The C++ kernel (every
build this CPU runs) and the Triton kernels are checked byte by byte in test_cpu_backend.py and
test_triton_backend.py.
"""

import contextlib
import io
import math

import pytest
import torch
from torch import nn

from oracle import AMD_FLOAT8, E8M0, FLOAT8, assert_stats_equal, float8_value, reference_stats

from overflow_fast import DebugUnderflowOverflow, tensor_stats
from overflow_fast.stats import cpu_backend, kinds, torch_backend
from overflow_fast.stats.layout import SMALLEST_NORMAL, decode_row
from test_tensor_kinds import Returns

NAN_BYTE = {torch.float8_e4m3fnuz: 0x80, torch.float8_e5m2fnuz: 0x80, **{dtype: 0xFF for dtype in E8M0}}


def ids(dtype):
    return str(dtype).replace("torch.", "")


def every_byte(dtype):
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)


def byte_cases(dtype):
    """Every byte alone, in 16-byte windows, all together and all but the NaN patterns."""
    every = every_byte(dtype)
    finite = every[~torch.isnan(every.float())]
    return ([every[i:i + 1] for i in range(256)] + [every[i:i + 16] for i in range(0, 256, 16)]
            + [every, finite])


@pytest.mark.parametrize("dtype", FLOAT8, ids=ids)
def test_the_oracle_decodes_every_byte_as_torch_does(dtype):
    every = every_byte(dtype)
    for byte, value in zip(range(256), every.float().double().tolist()):
        want = float8_value(byte, dtype)
        assert (math.isnan(want) and math.isnan(value)) or (want == value and math.copysign(1, want) ==
                                                             math.copysign(1, value)), (dtype, hex(byte), want, value)
    info = torch.finfo(dtype)
    finite = [abs(v) for v in map(float8_value, range(256), [dtype] * 256) if math.isfinite(v)]
    assert max(finite) == info.max
    assert SMALLEST_NORMAL[dtype] == info.smallest_normal
    # the smallest normal: an exponent field of 1, or e8m0fnu's smallest value
    normals = [m for m in finite if m >= SMALLEST_NORMAL[dtype]]
    assert min(normals) == info.smallest_normal


def test_the_amd_formats():
    """The rules the kernels rely on, from the oracle's decoding."""
    for dtype in AMD_FLOAT8:
        values = [float8_value(b, dtype) for b in range(256)]
        assert [b for b, v in enumerate(values) if math.isnan(v)] == [NAN_BYTE[dtype]]
        assert not any(math.isinf(v) for v in values)
        assert sum(v == 0 for v in values) == (0 if dtype in E8M0 else 1)  # no -0
    assert SMALLEST_NORMAL[torch.float8_e4m3fnuz] == 2.0**-7
    assert SMALLEST_NORMAL[torch.float8_e5m2fnuz] == 2.0**-15
    for dtype in E8M0:
        assert min(float8_value(b, dtype) for b in range(255)) == 2.0**-127


@pytest.mark.parametrize("dtype", AMD_FLOAT8, ids=ids)
def test_torch_backend_reads_every_byte(dtype):
    cases = byte_cases(dtype)
    rows = torch_backend.compute(cases).tolist()
    assert_stats_equal([decode_row(row, dtype) for row in rows], cases, f"torch {dtype}")


@pytest.mark.parametrize("dtype", AMD_FLOAT8, ids=ids)
def test_dispatch_takes_them(dtype):
    x = every_byte(dtype)
    assert kinds.unreadable_reason(x) is None and kinds.is_plain(x)
    layouts = [x, x[::3], x.reshape(16, 16).t(), x[7], x[:0]]
    for backend in (None, "torch"):
        assert_stats_equal(tensor_stats(layouts, backend=backend).tolist(), layouts, f"{backend} {dtype}")
    if cpu_backend.unavailable_reason() is None:
        assert cpu_backend.supports(x)
        assert torch.equal(tensor_stats([x]).values, tensor_stats([x], backend="cpu").values)


@pytest.mark.parametrize("dtype", AMD_FLOAT8, ids=ids)
def test_nan_count_of_a_nan_byte(dtype):
    x = torch.full((100,), 0x40, dtype=torch.uint8)
    x[37] = NAN_BYTE[dtype]
    x = x.view(dtype)
    (row,) = tensor_stats([x]).tolist()
    assert row["nan"] == 1 and math.isnan(row["abs_min"]) and math.isnan(row["abs_max"])
    assert row == {**reference_stats(x), "abs_min": row["abs_min"], "abs_max": row["abs_max"]}




@pytest.mark.parametrize("check", ["module", "batch"])
@pytest.mark.parametrize("dtype", AMD_FLOAT8, ids=ids)
def test_detector_reports_a_nan_byte(dtype, check):
    finite = torch.tensor([0x40, 0x01, 0x7E], dtype=torch.uint8).view(dtype)
    bad = finite.view(torch.uint8).clone()
    bad[1] = NAN_BYTE[dtype]
    bad = bad.view(dtype)
    model = nn.Sequential(Returns(finite), Returns(bad), nn.Identity())
    detector = DebugUnderflowOverflow(model, check=check)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), pytest.raises(ValueError, match="inf/nan detected"):
            model(torch.ones(2))
    finally:
        detector.remove()
    text = out.getvalue()
    assert "output has nans" in text, text
    lines = text.splitlines()
    stats = tensor_stats([finite]).tolist()[0]
    # the finite tensor's frame line, formatted as for any other dtype
    assert f"{stats['abs_min']:8.2e} {stats['abs_max']:8.2e} output" in lines, text
    assert f"{math.nan:8.2e} {math.nan:8.2e} output" in lines, text
    assert not any("unreadable" in line for line in lines), text
