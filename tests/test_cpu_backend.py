"""The C++ backend (csrc/, overflow_fast._C): exact equality with the float64 oracle and with the
torch backend, on every dtype, special value, layout and size class, on every kernel the loaded
build holds (the baseline one and its instruction set's; the others are skipped, saying why; .ci/run
runs this file once per instruction set this CPU runs). The fallback: tests/test_cpu_build.py."""

import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oracle import (ALL_DTYPES, E8M0, FLOAT8, assert_stats_equal, has_inf, random_bits, reference_stats, same_stats,
                    special_values, take)

from overflow_fast.stats import cpu_backend, cpu_build, dispatch, torch_backend
from overflow_fast.stats.layout import decode_row

pytestmark = pytest.mark.skipif(
    cpu_backend.unavailable_reason() is not None,
    reason=f"C++ extension unavailable: {cpu_backend.unavailable_reason()}",
)

FLOATING = [d for d in ALL_DTYPES if d.is_floating_point]


def capability_reasons():
    """{kernel build: why this module or CPU cannot run it, '' when it can}, for every build."""
    if cpu_backend._C is None or not hasattr(cpu_backend._C, "capabilities"):
        return {"default": ""}
    return dict(cpu_backend._C.capabilities())


def capabilities():
    """The kernel builds this CPU runs."""
    return [name for name, why in capability_reasons().items() if not why]


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.skipif(bool(why), reason=f"{name} kernel: {why}"))
                        for name, why in capability_reasons().items()])
def capability(request):
    """Run the test on each kernel build; those this CPU cannot run are skipped, saying why."""
    previous = cpu_backend._C.capability()
    cpu_backend._C.set_capability(request.param)
    yield request.param
    cpu_backend._C.set_capability(previous)


def cpu_stats(tensors):
    rows = cpu_backend.compute(list(tensors))
    assert rows.dtype == torch.int64 and rows.shape == (len(tensors), 8) and rows.device.type == "cpu"
    return [decode_row(row, t.dtype) for row, t in zip(rows.tolist(), tensors)]


def torch_stats(tensors):
    rows = torch_backend.compute(list(tensors))
    return [decode_row(row, t.dtype) for row, t in zip(rows.tolist(), tensors)]


def check(tensors, label=""):
    """Equal to the oracle and to the torch backend, field by field, NaN equal to NaN."""
    got = cpu_stats(tensors)
    assert_stats_equal(got, tensors, label)
    for g, w, t in zip(got, torch_stats(tensors), tensors):
        assert same_stats(g, w), f"{label} {t.dtype} {tuple(t.shape)}: cpu {g} != torch {w}"


def ids(dtype):
    return str(dtype).replace("torch.", "")


# Lengths around the vector widths (8..64 lanes), a flush block, and a thread split.
LENGTHS = [1, 2, 7, 8, 15, 16, 31, 33, 63, 64, 65, 127, 129, 4097, 127 * 32 + 5, 70_001]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_random_bit_patterns(dtype, capability):
    generator = torch.Generator().manual_seed(1)
    tensors = [random_bits(dtype, (n,), generator) for n in LENGTHS]
    check(tensors, capability)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_special_values_at_every_position(dtype, capability):
    generator = torch.Generator().manual_seed(2)
    specials = special_values(dtype)
    tensors = [specials]
    for n in (13, 40, 100, 1000):
        x = take(specials, torch.randint(0, len(specials), (n,), generator=generator))
        tensors.append(x)
    # each special value alone, at the end of an otherwise ordinary run
    ordinary = torch.ones(67, dtype=torch.float32).to(dtype) if dtype != torch.bool else torch.ones(67, dtype=dtype)
    for value in specials:
        x = ordinary.clone()
        x[-1] = value
        tensors.append(x)
    check(tensors, capability)


# The torch backend's (and the oracle's) statistics of a test's tensors, the same for every kernel
# build: computed for the first build, kept for the others (most of these tests' time).
_WANT = {}


@pytest.mark.parametrize("dtype", FLOAT8, ids=ids)
def test_every_byte_of_the_8_bit_floats(dtype, capability):
    """Each of the 256 bit patterns alone (the scalar loop), in the middle of a run of 1.0s (a
    whole vector: the keys-only pass), and filling a run (the counting passes)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    runs = torch.tensor([1.0]).to(dtype).view(torch.uint8).repeat(256, 300)
    runs[:, 150] = every
    filled = every.unsqueeze(1).expand(256, 300).contiguous()
    tensors = [every.view(dtype)] + list(every.view(dtype).split(1)) + list(runs.view(dtype)) + list(filled.view(dtype))
    check(tensors, capability)


@pytest.mark.parametrize("dtype", FLOATING + [torch.complex64, torch.complex128], ids=ids)
@pytest.mark.parametrize("n", [9, 17, 33, 67, 4096 * 32 + 3, 300_001])
@pytest.mark.parametrize("where", ["tail", "middle", "first"])
def test_one_special_value_anywhere(dtype, n, where, capability):
    """A lone NaN/inf/subnormal/zero in a run of ordinary values: in the scalar tail (after the
    last full vector), or inside one vector block of many (the kernel counts NaN and inf only
    in blocks whose largest magnitude is not finite)."""
    position = {"tail": n - 1, "middle": n // 2, "first": 0}[where]
    base = torch.full((n,), 0.5).to(dtype)
    tiny = {torch.float8_e4m3fn: 2.0**-8, torch.float8_e5m2: 2.0**-15}.get(
        dtype, torch.finfo(torch.float32 if dtype == torch.complex64 else
                           torch.float64 if dtype.is_complex else dtype).tiny / 2)
    values = [float("nan"), 0.0, tiny, -tiny]
    if has_inf(dtype):
        values += [float("inf"), float("-inf")]
    tensors = []
    for value in values:
        x = base.clone()
        x[position] = value
        tensors.append(x)
    got = cpu_stats(tensors)
    key = ("one special value", dtype, n, where)  # the same for every kernel build (_WANT below)
    if key not in _WANT:
        _WANT[key] = torch_stats(tensors)
    for g, w in zip(got, _WANT[key]):
        assert same_stats(g, w), (g, w)
    if n < 1000:
        assert_stats_equal(got, tensors)


# The vector kernels read 16 KB blocks and re-read a block only when its smallest / largest key
# says it can hold a zero, subnormal, NaN or inf: each case in one block of several, in every
# block, in none, at block edges and in the scalar tail (after the last whole vector).
BLOCK_BYTES = 16 * 1024
NON_COMPLEX = [d for d in ALL_DTYPES if not d.is_complex]


def _block_cases(dtype):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    block = BLOCK_BYTES // itemsize
    n = 5 * block + 64 // itemsize * 3 + 5  # 5 blocks, a partial block of 3 AVX-512 vectors, a tail
    if dtype == torch.bool:
        base, zero, others = torch.ones(n, dtype=dtype), False, []
    elif dtype.is_floating_point:
        base = torch.full((n,), 0.75).to(dtype)
        tiny = {torch.float8_e4m3fn: 2.0**-8, torch.float8_e5m2: 2.0**-15}.get(dtype, torch.finfo(dtype).tiny / 2)
        zero = 0.0
        others = [("negative zero", -0.0), ("subnormal", tiny), ("negative subnormal", -tiny), ("nan", float("nan"))]
        if has_inf(dtype):
            others += [("inf", float("inf")), ("-inf", float("-inf"))]
        others.append(("max finite", float(torch.finfo(dtype).max)))
    else:
        base = torch.full((n,), 3, dtype=dtype)
        zero = 0
        others = [("min", torch.iinfo(dtype).min), ("max", torch.iinfo(dtype).max)]
    cases = [("none", base.clone())]
    every = base.clone()
    every[::97] = zero
    cases.append(("zeros in every block", every))
    half = base.clone()
    half[::2] = zero  # ReLU-like: every block holds zeros
    cases.append(("half zeros", half))
    positions = {"block 3 only": 3 * block + 17, "last of block 1": block - 1, "first of block 2": block,
                 "partial block": 5 * block + 1, "tail": n - 1, "first": 0}
    for where, i in positions.items():
        x = base.clone()
        x[i] = zero
        cases.append((f"zero at {where}", x))
        for name, value in others:
            x = base.clone()
            x[i] = value
            cases.append((f"{name} at {where}", x))
    # the same runs starting off a vector boundary, so blocks cut them elsewhere
    cases += [(f"{label} [3:]", x[3:]) for label, x in cases[:3]]
    return cases


def _assert_cases(cases, dtype, capability, picks):
    """Every ``(label, tensor)`` case's row equals the torch backend's, and the cases at ``picks``
    the float64 oracle's (it walks elements in Python: a subset)."""
    tensors = [x for _, x in cases]
    got = cpu_stats(tensors)
    key = (dtype, tuple(label for label, _ in cases), tuple(picks))
    if key not in _WANT:
        _WANT[key] = (torch_stats(tensors), [reference_stats(tensors[i]) for i in picks])
    want_torch, want_oracle = _WANT[key]
    for (label, x), g, w in zip(cases, got, want_torch):
        assert same_stats(g, w), f"{capability} {dtype} {label}: cpu {g} != torch {w}"
    for i, w in zip(picks, want_oracle):
        assert same_stats(got[i], w), f"{capability} {dtype} {cases[i][0]}: cpu {got[i]} != oracle {w}"


@pytest.mark.parametrize("dtype", NON_COMPLEX, ids=ids)
def test_blocks_with_and_without_rare_values(dtype, capability):
    cases = _block_cases(dtype)
    # a subset covers every kind of case
    picks = [i for i, (label, _) in enumerate(cases) if "block 3" in label or "tail" in label or i < 3]
    _assert_cases(cases, dtype, capability, picks)


# After a block that held zeros the next block counts as it reads: integers their zeros; floats
# only |x| < smallest normal while no subnormal shows up (the zeros are then as many, and the
# smallest key 0, or the smallest nonzero key tracked on the side when the block held none), a
# block with a subnormal read again for its zeros, and both counts after such a block. Each
# switch at block edges, in partial blocks, at counter flushes (float8: 127 vectors), with the
# extreme keys (int min, whose |x| wraps; the smallest subnormal; max finite; NaN) in the
# counting blocks.
def _zero_run_cases(dtype):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    block = BLOCK_BYTES // itemsize
    # a partial last block of 7 AVX2 vectors: an odd count, the last one read alone by the loops
    # that take two per step
    n = 6 * block + 32 // itemsize * 7 + 5
    if dtype == torch.bool:
        base, zero = torch.ones(n, dtype=dtype), False
        extremes = []
    elif dtype.is_floating_point:
        base = torch.full((n,), 0.75).to(dtype)
        zero = 0.0
        tiny = {torch.float8_e4m3fn: 2.0**-8, torch.float8_e5m2: 2.0**-15}.get(dtype, torch.finfo(dtype).tiny / 2)
        smallest = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}.get(
            dtype, torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps)
        extremes = [("subnormal", tiny), ("smallest subnormal", smallest), ("-subnormal", -tiny),
                    ("smallest normal", float(torch.finfo(dtype).smallest_normal)),
                    ("max finite", float(torch.finfo(dtype).max)), ("nan", float("nan")), ("-0", -0.0)]
        if has_inf(dtype):
            extremes.append(("-inf", float("-inf")))
    else:
        base = torch.full((n,), 3, dtype=dtype)
        zero = 0
        info = torch.iinfo(dtype)
        extremes = [("min", info.min), ("max", info.max), ("1", 1), ("-1", -1) if info.min < 0 else ("2", 2)]
    cases = []
    runs = {"zeros everywhere": (0, n), "zeros in blocks 0-1": (0, 2 * block), "zeros from block 2": (2 * block, n),
            "zeros in block 1 only": (block, 2 * block), "zeros in blocks 1-2 and the partial block": (block, 3 * block)}
    for run, (lo, hi) in runs.items():
        x = base.clone()
        x[lo:hi:2] = zero  # a zero in every other element: every block of the run counts
        cases.append((run, x))
        for name, value in extremes:
            for where in (hi - 1, block * 3):
                y = x.clone()
                y[min(where, n - 1)] = value
                cases.append((f"{run}, {name} at {where}", y))
    all_zero = torch.zeros(n).to(dtype) if dtype != torch.bool else torch.zeros(n, dtype=dtype)
    cases.append(("all zero", all_zero))
    if dtype.is_floating_point:
        sub = base.clone()
        sub[::2] = extremes[0][1]  # subnormals in every block: both counts after the first
        cases.append(("subnormals everywhere", sub))
        mixed = sub.clone()
        mixed[1::4] = zero
        cases.append(("subnormals and zeros everywhere", mixed))
        x = base.clone()
        x[: 2 * block : 2] = extremes[0][1]
        x[2 * block :: 2] = zero
        cases.append(("subnormals in blocks 0-1, then zeros", x))
    cases += [(f"{label} [5:]", x[5:]) for label, x in cases[:5]]
    return cases


# float8_e8m0fnu has no zero (its 0.0 converts to 2^-127): nothing for this test to count
@pytest.mark.parametrize("dtype", [d for d in NON_COMPLEX if d not in E8M0], ids=ids)
def test_runs_of_zero_blocks(dtype, capability):
    cases = _zero_run_cases(dtype)
    # a few cases of each kind
    picks = [i for i, (label, _) in enumerate(cases)
             if label in ("zeros in blocks 0-1", "subnormals and zeros everywhere", "all zero")
             or label.startswith("zeros in block 1 only, ") and label.split(", ")[1].split(" at ")[0] in ("min", "subnormal")]
    _assert_cases(cases, dtype, capability, picks[:3])


# On AVX2, int64 is read on 32-bit lanes while a block's values fit in int32 (kernel.h,
# narrow_int64_block), and on 64-bit lanes from the first block where one does not. Values just
# inside and just outside int32 (whose high half is the sign of the low half, or not), in the
# first block, in a later one, in a block's lone last vector (read as both halves of a pair) and
# in the scalar tail; with runs of zeros (the counting reads) and without.
INT32_EDGES = [2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 2**32 - 1, 2**32, 2**32 + 1, -(2**32),
               -(2**32) + 1, -(2**32) - 1, 2**63 - 1, -(2**63)]


def test_int64_values_around_the_int32_range(capability):
    block = BLOCK_BYTES // 8
    n = 3 * block + 4 + 3  # three blocks, a block of one vector, a scalar tail of 3
    generator = torch.Generator().manual_seed(11)
    plain = torch.randint(-1000, 1000, (n,), generator=generator, dtype=torch.int64)
    plain[plain == 0] = 7
    zeros = plain.clone()
    zeros[block::2] = 0  # zeros from block 1 on: the blocks after it count as they read
    cases = [("fits", plain), ("fits, zeros", zeros),
             ("int32 min everywhere", torch.full((n,), -(2**31), dtype=torch.int64)),
             ("int32 extremes alternating", torch.tensor([2**31 - 1, -(2**31)] * (n // 2), dtype=torch.int64))]
    for base_label, base in (("", plain), ("zeros, ", zeros)):
        for value in INT32_EDGES:
            for where in (0, 2 * block + 5, 3 * block + 1, n - 1):
                x = base.clone()
                x[where] = value
                cases.append((f"{base_label}{value} at {where}", x))
    picks = list(range(4)) + list(range(4, len(cases), 9))
    _assert_cases(cases, torch.int64, capability, picks)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_empty_and_zero_dim(dtype, capability):
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.empty(0, dtype=dtype),
        torch.empty(3, 0, 2, dtype=dtype),
        random_bits(dtype, (), generator),
        special_values(dtype)[0].clone(),
        special_values(dtype)[-1].clone(),
    ]
    got = cpu_stats(tensors)
    assert got[0]["numel"] == got[1]["numel"] == 0 and got[0]["abs_min"] is None
    check(tensors, capability)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_non_contiguous_layouts(dtype, capability):
    generator = torch.Generator().manual_seed(4)
    x = random_bits(dtype, (6, 7, 5), generator)
    tensors = [
        x.transpose(0, 2),                # dense: one flat run over its memory
        x.permute(1, 2, 0),
        x[:, 1:5],                        # rows
        x[1:4, 2:, :3],
        x[..., 2],                        # innermost stride 5: read through a copy
        x[:, ::2, ::2],
        x[:, :1].expand(6, 9, 5),         # stride 0: read once, counts scaled
        x[2, 3, 4].expand(3, 4),
        x[:1, :1, :].expand(4, 3, 5).transpose(0, 2),
        x.transpose(0, 1)[:, 1:4],
        x.reshape(-1).as_strided((5, 4), (3, 1)),  # overlapping rows
    ]
    if dtype.is_complex:
        tensors += [x.conj(), x.transpose(0, 1).conj(), torch._neg_view(x)]
    if dtype.is_floating_point and dtype not in FLOAT8:  # no neg kernel
        tensors += [torch._neg_view(x), torch._neg_view(x[:, 1:5])]
    check(tensors, capability)


def test_plain_cpu_tensors_take_one_kernel_call(monkeypatch):
    """tensor_stats on plain CPU tensors (a hook's call) goes straight to the kernel, which checks
    them itself; a list it refuses (a sparse tensor, out overlapping an input) takes the general
    path, with that path's result or error."""
    calls = []
    real_compute = cpu_backend.compute
    monkeypatch.setattr(cpu_backend, "compute", lambda tensors, out=None: calls.append(len(tensors)) or real_compute(tensors, out))
    monkeypatch.setattr(dispatch, "_choices", {})
    chosen = []
    real_choose = dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda *a: chosen.append(a[0]) or real_choose(*a))
    tensors = [torch.randn(3, 5), torch.arange(-4, 4), torch.tensor([0.0, float("nan")], dtype=torch.bfloat16),
               torch.nn.Parameter(torch.ones(2)), torch.zeros(0), torch.randn(4, 4).t()]
    batch = dispatch.tensor_stats(tensors)
    assert calls == [len(tensors)] and chosen == []
    assert all(map(same_stats, batch.tolist(), dispatch.tensor_stats(tensors, "torch").tolist()))

    calls.clear()
    mixed = tensors[:2] + [torch.tensor([[0.0, 2.0], [0.0, 0.0]]).to_sparse()]
    assert all(map(same_stats, dispatch.tensor_stats(mixed).tolist(), dispatch.tensor_stats(mixed, "torch").tolist()))
    assert chosen  # the general path read the list

    buffer = torch.zeros(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="overlap"):
        dispatch.tensor_stats([buffer.view(torch.float64)[:2]], out=buffer[1:2])


def test_many_tensors_in_one_call(capability):
    """Mixed dtypes and sizes in one call, enough bytes to split across threads mid-tensor."""
    generator = torch.Generator().manual_seed(5)
    tensors = []
    for i in range(120):
        dtype = ALL_DTYPES[i % len(ALL_DTYPES)]
        n = [0, 1, 37, 300, 2000][i % 5]
        tensors.append(random_bits(dtype, (n,), generator))
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        big = random_bits(dtype, (700_003,), generator)
        tensors.insert(len(tensors) // 2, big)
    got = cpu_stats(tensors)
    want = torch_stats(tensors)
    for g, w, t in zip(got, want, tensors):
        assert same_stats(g, w), (t.dtype, t.shape, g, w)
    small = [(g, t) for g, t in zip(got, tensors) if t.numel() <= 2000]
    assert_stats_equal([g for g, _ in small], [t for _, t in small])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.float8_e5m2,
                                   torch.int32, torch.uint8, torch.complex64], ids=ids)
def test_large_tensors_same_for_any_thread_count(dtype, capability):
    """Chunk and thread boundaries fall inside tensors; the result must not depend on them."""
    generator = torch.Generator().manual_seed(6)
    tensors = [random_bits(dtype, (n,), generator) for n in (1_000_003, 3_000_017)]
    tensors.append(random_bits(dtype, (1500, 1201), generator)[:, 3:1190])  # many rows
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(cpu_backend.compute(tensors))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    for g, w in zip(cpu_stats(tensors), torch_stats(tensors)):
        assert same_stats(g, w), (g, w)


def test_parameters_and_tuples():
    weight = torch.nn.Parameter(torch.tensor([[0.0, -2.0], [float("inf"), 3.0]]))
    rows = cpu_backend.compute((weight, weight.detach().t()))
    assert torch.equal(rows[0], rows[1]) and not rows.requires_grad
    check([weight.detach()])


def test_exact_integer_extremes():
    tensors = [
        torch.tensor([-(2**63), 5], dtype=torch.int64),
        torch.full((100,), -(2**31), dtype=torch.int32),
        torch.tensor([-128] * 40 + [0], dtype=torch.int8),
        torch.tensor([255] * 70, dtype=torch.uint8),
    ]
    got = cpu_stats(tensors)
    assert got[0]["abs_max"] == 2**63 and got[0]["abs_min"] == 5
    assert got[1]["abs_min"] == got[1]["abs_max"] == 2**31
    assert got[2]["abs_max"] == 128 and got[2]["abs_min"] == 0 and got[2]["zero"] == 1
    assert got[3]["abs_min"] == got[3]["abs_max"] == 255
    check(tensors)


def test_unsupported_inputs():
    unsupported = [torch.zeros(3, dtype=d) for d in (torch.uint16, torch.uint32)
                   if hasattr(torch, str(d).replace("torch.", ""))]
    for x in unsupported:
        assert not cpu_backend.supports(x)
        with pytest.raises(RuntimeError, match="unsupported dtype"):
            cpu_backend.compute([x])
    meta = torch.zeros(3, device="meta")
    assert not cpu_backend.supports(meta)
    with pytest.raises(RuntimeError, match="not the CPU"):
        cpu_backend.compute([meta])
    assert cpu_backend.supports(torch.zeros(3))
    assert cpu_backend.compute([]).shape == (0, 8)


def test_dispatch_prefers_the_cpu_backend():
    x = torch.tensor([1.0, float("inf"), -2.0])
    batch = dispatch.tensor_stats([x])
    assert dispatch.backend_status()["cpu"] is None
    assert batch.tolist() == dispatch.tensor_stats([x], backend="torch").tolist()


# ---------------------------------------------------------------------------------------------
# Property test: any shape, dtype, layout and mix of special values.

@st.composite
def tensor_cases(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    x = random_bits(dtype, shape, generator)
    if x.numel() and draw(st.booleans()):
        specials = special_values(dtype)
        picks = torch.randint(0, len(specials), (x.numel(),), generator=generator)
        keep = torch.rand(x.numel(), generator=generator) < draw(st.floats(0, 1))
        x = torch.where(keep.reshape(shape), x, specials[picks].reshape(shape))
    layout = draw(st.sampled_from(["plain", "transpose", "slice", "step", "expand"]))
    if layout == "transpose" and x.dim() >= 2:
        x = x.transpose(0, -1)
    elif layout == "slice" and x.dim() >= 1 and x.shape[-1] > 1:
        x = x[..., 1:]
    elif layout == "step" and x.dim() >= 1:
        x = x[..., ::2]
    elif layout == "expand":
        x = x.unsqueeze(0).expand(3, *x.shape)
    return x


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tensor_cases(), min_size=1, max_size=4), st.sampled_from(capabilities()))
def test_property_equal_to_oracle(tensors, capability_name):
    previous = cpu_backend._C.capability()
    cpu_backend._C.set_capability(capability_name)
    try:
        check(tensors, capability_name)
    finally:
        cpu_backend._C.set_capability(previous)


# ---------------------------------------------------------------------------------------------
# Over 2^31 elements: int64 indexing, in one flat run and in rows.

def test_over_two_to_the_31_elements(capability):
    n = 2**31 + 77
    try:
        x = torch.zeros(n, dtype=torch.uint8)
    except RuntimeError as error:  # not enough memory on this machine
        pytest.skip(f"cannot allocate {n} bytes: {error}")
    x[0] = 3
    x[2**31 - 1] = 200
    x[2**31 + 5] = 9
    x[-1] = 250
    rows = cpu_stats([x, x.view(torch.bool), x[1:].as_strided((2, 2**30 + 30), (2**30 + 38, 1))])
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the whole tensor in one run of the kernel
        assert same_stats(cpu_stats([x])[0], rows[0])
    finally:
        torch.set_num_threads(previous)
    assert rows[0] == {"abs_min": 0, "abs_max": 250, "nan": 0, "posinf": 0, "neginf": 0,
                       "zero": n - 4, "subnormal": 0, "numel": n}
    assert rows[1]["zero"] == n - 4 and rows[1]["abs_max"] == 1.0 and rows[1]["numel"] == n
    # rows of 2^30+30 elements from elements 1 and 2^30+39: they hold 2^31-1 (200) and 2^31+5 (9),
    # not elements 0 and n-1
    assert rows[2] == {"abs_min": 0, "abs_max": 200, "nan": 0, "posinf": 0, "neginf": 0,
                       "zero": 2 * (2**30 + 30) - 2, "subnormal": 0, "numel": 2 * (2**30 + 30)}
    del x


# ---------------------------------------------------------------------------------------------
# Fallback (a failed build, a module that does not load or does not match) warns once and the
# torch backend answers: tests/test_cpu_build.py.

# ---------------------------------------------------------------------------------------------
# Run-time choice of kernel. A build holds the baseline kernel and its instruction set's, all
# compiled for that instruction set (cpu_build.py); the suite runs on the best build this CPU
# runs, and .ci/run runs this file again with ATEN_CPU_CAPABILITY set to each lower one.

_CAPABILITY = "from overflow_fast.stats import cpu_backend; print(cpu_backend.extension().capability())"


@pytest.mark.slow  # builds the baseline kernel (about a minute)
def test_baseline_kernel_when_torch_is_told_so():
    """ATEN_CPU_CAPABILITY=default (torch's switch for the baseline kernels) selects ours too."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", _CAPABILITY], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "default"


AVX512_REGISTER = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")


def test_no_instruction_beyond_the_builds_instruction_set():
    """The module is compiled for one instruction set and loaded only on a CPU that has it (the
    build's key names it): a baseline build holds no AVX instruction at all, an AVX2 build no
    AVX-512 register; and the kernel namespaces of the build are there."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found")
    isa = cpu_backend.details()["isa"]
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", cpu_backend._C.__file__],
                             capture_output=True, text=True, check=True).stdout
    function, offenders, namespaces = None, set(), set()
    for line in listing.splitlines():
        if line.endswith(">:") and " <" in line:
            function = line.split(" <", 1)[1][:-2]
            namespaces.update(re.findall(r"overflow_fast::(AVX512|AVX2|DEFAULT)::", function))
        elif "\t" in line:
            mnemonic = line.split("\t")[1].split(" ")[0] if len(line.split("\t")) > 1 else ""
            avx512 = AVX512_REGISTER.search(line) is not None
            if (isa == "baseline" and (mnemonic.startswith("v") or "%ymm" in line or avx512)) or (
                    isa == "avx2" and avx512):
                offenders.add(function)
    assert not offenders, sorted(offenders)[:10]
    assert namespaces == {"DEFAULT", {"baseline": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}[isa]}


def test_forcing_a_kernel_the_cpu_lacks_is_refused():
    """set_capability names what is missing; the kernel in use does not change."""
    previous = cpu_backend._C.capability()
    for name, why in capability_reasons().items():
        if why:
            with pytest.raises(RuntimeError, match=f"cannot use the '{name}' kernel: .*(lacks|built without)"):
                cpu_backend._C.set_capability(name)
            assert cpu_backend._C.capability() == previous
    with pytest.raises(RuntimeError, match="unknown capability 'sse'"):
        cpu_backend._C.set_capability("sse")
    # the build chosen at load time is the best this CPU runs
    assert previous == capabilities()[-1]


@pytest.mark.slow  # builds the AVX2 kernel (about a minute)
def test_aten_cpu_capability_caps_the_choice():
    """ATEN_CPU_CAPABILITY=avx2 (torch's own cap) keeps an AVX-512 CPU on the AVX2 kernel too."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", _CAPABILITY], env=env, capture_output=True, text=True, check=True)
    best = cpu_build.detect_isa()
    assert out.stdout.strip() == ("avx2" if best in ("avx2", "avx512") else "default")


def test_rows_written_into_out(capability):
    # the kernel writes a caller's rows (check="batch" passes the next rows of its buffer)
    x = torch.tensor([1.5, float("nan"), -3.0])
    buffer = torch.full((4, 8), -1, dtype=torch.int64)
    rows = cpu_backend.compute([x, torch.zeros(0)], out=buffer[1:3])
    assert rows.data_ptr() == buffer[1].data_ptr()
    want = torch_backend.compute([x, torch.zeros(0)]).tolist()
    for got_row, want_row in zip(rows.tolist(), want):  # NaN payloads may differ: compare values
        assert same_stats(decode_row(got_row, torch.float32), decode_row(want_row, torch.float32))
    assert (buffer[0] == -1).all() and (buffer[3] == -1).all()
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU int64 tensor"):
        cpu_backend.compute([x], out=torch.zeros(2, 8, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Defence in depth: the binding checks every input itself. Anything that is not a plain,
# storage-backed CPU tensor is a RuntimeError naming the tensor, never a read of memory it
# does not own. Run in a subprocess: a segfault there fails the test instead of killing pytest.

_BINDING_CASES = r'''
import sys, torch
from overflow_fast.stats import cpu_backend
C = cpu_backend.extension()
from torch._subclasses.fake_tensor import FakeTensorMode

class Wrapper(torch.Tensor):  # the DTensor / torchao pattern: no storage of its own
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
    def __init__(self, inner):
        self.inner = inner
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        un = lambda a: a.inner if isinstance(a, Wrapper) else a
        return func(*[un(a) for a in args], **{k: un(v) for k, v in (kwargs or {}).items()})

def case(name, tensors, out=None):
    print("CASE", name, flush=True)  # the last one printed is the one that crashed
    try:
        C.compute(tensors, out)
        print("RESULT", name, "no error", flush=True)
    except RuntimeError as error:
        print("RESULT", name, str(error).splitlines()[0], flush=True)

ok = torch.ones(3)
case("wrapper", [Wrapper(torch.tensor([1.0, 2.0]))])
case("wrapper second", [ok, Wrapper(torch.tensor([1.0, 2.0]))])
case("wrapper empty", [Wrapper(torch.zeros(0))])
with FakeTensorMode():
    fake = torch.ones(3)
case("fake", [fake])
case("meta", [torch.ones(3, device="meta")])
freed = torch.ones(4)
freed.untyped_storage().resize_(0)  # as FSDP frees a parameter's storage
case("freed storage", [freed])
base = torch.ones(4)
tail = base[2:]
base.untyped_storage().resize_(8)  # the view now reaches past the end of its storage
case("past the end", [ok, tail])
case("zero tensor", [torch._efficientzerotensor(3)])
case("nested", [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])])
case("jagged", [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)])
def inside_vmap(x):
    case("vmap", [x])
    return x.sum()
torch.func.vmap(inside_vmap)(torch.ones(2, 3))
torch.func.grad(inside_vmap)(torch.ones(3))
rows = torch.ones(2, 8, dtype=torch.int64)
case("out is an input", [ok, rows], out=rows)
print("INTACT", bool((rows == 1).all()), flush=True)
buffer = torch.ones(3, 8, dtype=torch.int64)
case("out overlaps a view", [buffer[1, 4:]], out=buffer[1:2])
case("out beside an input", [buffer[2]], out=buffer[1:2])
case("out wrapper", [ok], out=Wrapper(torch.zeros(1, 8, dtype=torch.int64)))
case("out meta", [ok], out=torch.zeros(1, 8, dtype=torch.int64, device="meta"))
case("out float", [ok], out=torch.zeros(1, 8))
case("out strided", [ok], out=torch.zeros(1, 16, dtype=torch.int64)[:, ::2])
freed_out = torch.zeros(1, 8, dtype=torch.int64)
freed_out.untyped_storage().resize_(0)
case("out freed", [ok], out=freed_out)
print("DONE", flush=True)
'''

_BINDING_EXPECTED = {
    "wrapper": "tensors[0] is a tensor subclass that dispatches to Python",
    "wrapper second": "tensors[1] is a tensor subclass that dispatches to Python",
    "wrapper empty": "tensors[0] is a tensor subclass that dispatches to Python",
    "fake": "tensors[0] is a tensor subclass that dispatches to Python",
    "meta": "tensors[0] is on meta, not the CPU",
    "freed storage": "tensors[0] has 4 elements but no storage or a null data pointer",
    "past the end": "tensors[1] (sizes [2], strides [1], storage offset 2, 4 bytes per element) "
                    "reaches past the end of its storage of 8 bytes",
    "zero tensor": "tensors[0] is an efficient zero tensor",
    "nested": "tensors[0] is a nested tensor",
    "jagged": "tensors[0] is a tensor subclass that dispatches to Python",  # torch's NestedTensor
    "vmap": "tensors[0] is a functorch-wrapped tensor",
    "out is an input": "out overlaps the memory of tensors[1]",
    "out overlaps a view": "out overlaps the memory of tensors[0]",
    "out beside an input": "no error",
    "out wrapper": "out is a tensor subclass that dispatches to Python",
    "out meta": "out is on meta, not the CPU",
    "out float": "out must be a contiguous CPU int64 tensor",
    "out strided": "out must be a contiguous CPU int64 tensor",
    "out freed": "out has 8 elements but no storage or a null data pointer",
}


def test_binding_rejects_what_it_cannot_read():
    proc = subprocess.run([sys.executable, "-c", _BINDING_CASES], capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and "DONE" in lines, (
        f"exit {proc.returncode} (a negative status is a signal: -11 a segfault) after "
        f"{[l for l in lines if l.startswith('CASE')][-1:]}\n{proc.stderr[-3000:]}"
    )
    results = {}
    for line in lines:
        if line.startswith("RESULT "):
            name, _, message = line[len("RESULT "):].partition(" overflow_fast._C.compute: ")
            if not message:
                name, message = line[len("RESULT "):].rsplit(" no error", 1)[0], "no error"
            results.setdefault(name, []).append(message)
    assert "INTACT True" in lines  # the input given as out was not zeroed
    for name, expected in _BINDING_EXPECTED.items():
        assert name in results, (name, sorted(results))
        for message in results[name]:  # vmap and grad both report as "vmap"
            assert message.startswith(expected), (name, message)


def test_out_overlapping_an_input_is_refused_and_the_input_kept():
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
    rows = x.view(torch.int64)  # the same memory, as the rows it would be asked to fill
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"out overlaps the memory of tensors\[0\]"):
        cpu_backend.compute([x], out=rows)
    assert torch.equal(x, before)


# ---------------------------------------------------------------------------------------------
# Complex: nan/inf by parts, magnitudes in float64 without overflow; cpu and
# torch backends against the oracle (the triton backend takes no complex).

COMPLEX = [torch.complex32, torch.complex64, torch.complex128]
BACKENDS = {"cpu": cpu_stats, "torch": torch_stats}


def _complex(dtype, pairs):
    part = {torch.complex32: torch.float16, torch.complex64: torch.float32}.get(dtype, torch.float64)
    return torch.view_as_complex(torch.tensor(pairs, dtype=torch.float64).to(part).contiguous())


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_semantics(backend):
    stats = BACKENDS[backend]
    inf, nan = float("inf"), float("nan")
    cases = [
        # finite parts, magnitude above float32's range: no inf (the reference's isinf agrees)
        (torch.complex64, [[3e38, 3e38]], dict(abs_max=math.hypot(float(torch.tensor(3e38)), float(torch.tensor(3e38))),
                                                posinf=0, nan=0)),
        # an infinite and a NaN part: counted as both, magnitude inf (hypot, torch's abs)
        (torch.complex64, [[inf, nan], [1.0, 0.0]], dict(abs_max=inf, abs_min=1.0, posinf=1, nan=1)),
        (torch.complex128, [[nan, inf]], dict(abs_max=inf, abs_min=inf, posinf=1, nan=1)),
        # a NaN part alone: magnitude NaN
        (torch.complex64, [[nan, 0.0], [2.0, 0.0]], dict(abs_max=nan, abs_min=nan, posinf=0, nan=1)),
        # complex128: the magnitude itself overflows float64, the parts are finite
        (torch.complex128, [[1.5e308, 1.5e308], [1.0, 0.0]], dict(abs_max=inf, abs_min=1.0, posinf=0, nan=0)),
        (torch.complex128, [[-inf, 0.0], [0.0, -inf]], dict(abs_max=inf, posinf=2, neginf=0, nan=0)),
        # complex32: float16 parts, magnitude in float64; subnormal below 2^-14
        (torch.complex32, [[65504.0, 65504.0]], dict(abs_max=math.hypot(65504.0, 65504.0), posinf=0)),
        (torch.complex32, [[2.0**-15, 0.0], [2.0**-14, 0.0], [0.0, -0.0], [inf, 1.0]],
         dict(subnormal=1, zero=1, abs_min=0.0, abs_max=inf, posinf=1)),
        (torch.complex64, [[2.0**-127, 2.0**-127], [2.0**-126, 0.0]], dict(subnormal=1, abs_min=math.hypot(2.0**-127, 2.0**-127))),
    ]
    for dtype, pairs, want in cases:
        x = _complex(dtype, pairs)
        (got,) = stats([x])
        assert_stats_equal([got], [x], f"{backend} {pairs}")
        for key, value in want.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[key]), (pairs, key, got)
            else:
                assert got[key] == value, (pairs, key, got)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_complex_magnitudes_element_by_element(dtype):
    """Parts of similar size, where hypot implementations differ in the last place (glibc's by one
    ulp for about 1% of them): each element alone, so its magnitude is the row's abs_min."""
    generator = torch.Generator().manual_seed(9)
    part = {torch.complex32: torch.float16, torch.complex64: torch.float32}.get(dtype, torch.float64)
    re = random_bits(part, (3000,), generator).double()
    im = (re * (torch.rand(3000, generator=generator, dtype=torch.float64) * 1.5 + 0.5))
    pairs = torch.stack([re, im], dim=-1).to(part)
    if dtype == torch.complex128:  # and results near and below the smallest normal
        tiny = torch.rand(500, 2, generator=generator, dtype=torch.float64) * 2.0**-1021
        pairs = torch.cat([pairs, tiny])
    values = torch.view_as_complex(pairs.contiguous())
    tensors = [values[i:i + 1] for i in range(values.numel())]
    got = cpu_stats(tensors)
    assert_stats_equal(got, tensors, "cpu")
    # the torch backend computes the same magnitudes in one vectorised pass
    mags = torch_backend._magnitude(values.to(torch.complex128).real, values.to(torch.complex128).imag)
    for i, (g, m) in enumerate(zip(got, mags.tolist())):
        assert same_stats({"m": g["abs_min"]}, {"m": m}), (i, values[i].item(), g["abs_min"], m)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_complex_rows_where_the_exact_magnitude_is_skipped(dtype, capability):
    """The kernel computes a magnitude exactly only when the squared magnitude cannot prove that
    it is neither a new min/max nor near the subnormal threshold: whole tensors of values close
    to each other and to the threshold, in several orders, equal the oracle."""
    generator = torch.Generator().manual_seed(10)
    part = {torch.complex32: torch.float16, torch.complex64: torch.float32}.get(dtype, torch.float64)
    tiny = torch.finfo(part).tiny
    base = torch.rand(4000, 2, generator=generator, dtype=torch.float64) * 0.01 + 1.0
    near_tiny = (torch.rand(2000, 2, generator=generator, dtype=torch.float64) * 0.2 + 0.6) * tiny
    tensors = []
    for pairs in (base, near_tiny, torch.cat([base * 1e3, near_tiny, base])):
        for order in (pairs, pairs.flip(0), pairs[torch.randperm(len(pairs), generator=generator)]):
            tensors.append(torch.view_as_complex(order.to(part).contiguous()))
    check(tensors, capability)
