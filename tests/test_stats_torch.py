"""The portable torch backend against the independent float64 oracle, and tensor_stats' API."""

import math
import warnings

import pytest
import torch

import oracle
from overflow_fast import StatsBatch, tensor_stats
from overflow_fast._compat import dtypes
from overflow_fast.stats import FIELDS, dispatch


def layouts(dtype, generator):
    """Random bit patterns in every layout the engine must read."""
    base = oracle.random_bits(dtype, (6, 10), generator)
    return [
        oracle.special_values(dtype),
        base,
        base.t(),  # transposed: dense but not contiguous
        base[:, ::3],  # strided slice
        base[1:4, 2:9],  # offset window
        oracle.random_bits(dtype, (), generator),  # 0-dim
        oracle.random_bits(dtype, (1,), generator).expand(5),  # stride 0
        torch.empty(0, 4, dtype=dtype),
        oracle.random_bits(dtype, (3, 4, 5), generator).permute(2, 0, 1),
    ]


@pytest.mark.parametrize("dtype", oracle.ALL_DTYPES, ids=str)
def test_exact_against_float64_reference(dtype):
    generator = torch.Generator().manual_seed(1234)
    tensors = layouts(dtype, generator)
    got = tensor_stats(tensors, backend="torch").tolist()
    oracle.assert_stats_equal(got, tensors, str(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e5m2], ids=str)
def test_special_values_one_by_one(dtype):
    # each special value alone, and next to ordinary values, so no statistic can hide behind another
    values = oracle.special_values(dtype)
    tensors = [values[i:i + 1] for i in range(values.numel())]
    tensors += [torch.cat([values[i:i + 1], torch.ones(3, dtype=dtype)]) for i in range(values.numel())]
    oracle.assert_stats_equal(tensor_stats(tensors, backend="torch").tolist(), tensors, str(dtype))


def test_known_values():
    x = torch.tensor([0.0, -0.0, 1e-40, -3.0, float("inf"), float("-inf"), float("-inf")])
    (stats,) = tensor_stats([x], backend="torch").tolist()
    assert stats == {"abs_min": 0.0, "abs_max": math.inf, "nan": 0, "posinf": 1, "neginf": 2, "zero": 2,
                     "subnormal": 1, "numel": 7}
    (stats,) = tensor_stats([torch.tensor([-128, 5], dtype=torch.int8)], backend="torch").tolist()
    assert stats["abs_min"] == 5 and stats["abs_max"] == 128  # no wrap-around at the most negative value
    (stats,) = tensor_stats([torch.tensor([-(2**63), 1], dtype=torch.int64)], backend="torch").tolist()
    assert stats["abs_max"] == 2**63
    (stats,) = tensor_stats([torch.tensor([2.0, float("nan")], dtype=torch.bfloat16)], backend="torch").tolist()
    assert math.isnan(stats["abs_min"]) and math.isnan(stats["abs_max"]) and stats["nan"] == 1
    (stats,) = tensor_stats([torch.zeros(0)], backend="torch").tolist()
    assert stats["abs_min"] is None and stats["abs_max"] is None and stats["numel"] == 0
    # float8_e4m3fn has no infinity: 0x7F is NaN, 0x7E is 448
    x = torch.tensor([0x7E, 0x7F, 0xFE], dtype=torch.uint8).view(torch.float8_e4m3fn)
    (stats,) = tensor_stats([x], backend="torch").tolist()
    assert stats["nan"] == 1 and stats["posinf"] == 0 and stats["neginf"] == 0 and math.isnan(stats["abs_max"])


def test_batch_keeps_results_on_device_and_in_order():
    tensors = [torch.ones(3), torch.zeros(2, dtype=torch.int32), torch.tensor(True)]
    batch = tensor_stats(tensors, backend="torch")
    assert isinstance(batch, StatsBatch) and len(batch) == 3
    assert batch.values.shape == (3, 8) and batch.values.dtype == torch.int64
    rows = batch.tolist()
    assert [tuple(r) for r in rows] == [FIELDS] * 3
    assert [r["numel"] for r in rows] == [3, 2, 1]
    assert rows[1]["abs_max"] == 0 and rows[2]["abs_min"] == 1.0
    assert tensor_stats([], backend="torch").tolist() == []


def test_tensors_with_grad_and_parameters():
    p = torch.nn.Parameter(torch.tensor([-2.0, 1.0]))
    (stats,) = tensor_stats([p * 3], backend="torch").tolist()
    assert stats["abs_max"] == 6.0


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.ones(2),), TypeError, "wrap a single tensor"),
        (([torch.ones(2), 3.0],), TypeError, r"tensors\[1\] is a float"),
        (("abc",), TypeError, "list or tuple"),
        (([torch.ones(2)], "gpu"), ValueError, "unknown backend"),
        (([torch.ones(2)], 1), TypeError, "backend"),
        (([torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)],), TypeError,
         r"tensors\[0\] cannot be read: (quantized|dtype qint8)"),
        (([torch.ones(2, device="meta")],), TypeError, "meta"),
        *[(([torch.zeros(2, dtype=torch.uint8).view(dtype)],), TypeError, "dtype float4_e2m1fn_x2 is not supported")
          for dtype in dtypes("float4_e2m1fn_x2")],  # from torch 2.8
    ],
)
def test_bad_input_gets_a_clear_error(args, error, message):
    with pytest.raises(error, match=message):
        tensor_stats(*args)


def test_environment_variable_overrides_the_choice(monkeypatch):
    monkeypatch.setenv("OVERFLOW_FAST_BACKEND", "torch")
    batch = tensor_stats([torch.ones(2)])
    assert batch.groups[0][1].shape == (1, 8)
    monkeypatch.setenv("OVERFLOW_FAST_BACKEND", "fastest")
    with pytest.raises(ValueError, match="OVERFLOW_FAST_BACKEND"):
        tensor_stats([torch.ones(2)])


def test_broken_backend_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setitem(dispatch._MODULES, "cpu", "overflow_fast.no_such_module")
    monkeypatch.setattr(dispatch, "_loaded", {})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_choices", {})
    monkeypatch.delenv("OVERFLOW_FAST_BACKEND", raising=False)
    with pytest.warns(RuntimeWarning, match="'cpu' backend is unavailable"):
        first = tensor_stats([torch.tensor([-3.0])]).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tensor_stats([torch.tensor([-3.0])]).tolist()
    assert first == second and first[0]["abs_max"] == 3.0
    with pytest.raises(RuntimeError, match="backend='cpu' is unavailable"):
        tensor_stats([torch.ones(1)], backend="cpu")
    assert dispatch.backend_status()["cpu"] is not None


def test_a_preferred_backend_holds_within_its_block_and_the_choice_is_made_again_after(monkeypatch):
    monkeypatch.setitem(dispatch._MODULES, "broken", "overflow_fast.no_such_module")
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.delenv("OVERFLOW_FAST_BACKEND", raising=False)
    x = torch.tensor([-3.0, float("-inf"), 0.0, 1e-40])
    before = tensor_stats([x]).tolist()
    with dispatch.preferring("cpu", "broken"):
        with pytest.warns(RuntimeWarning, match="'broken' backend is unavailable"):
            within = tensor_stats([x]).tolist()  # the torch backend, said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = tensor_stats([x]).tolist()  # the CPU's own choice again, nothing to say
    assert before == within == after
    assert after[0]["neginf"] == 1 and after[0]["zero"] == 1 and after[0]["subnormal"] == 1


@pytest.mark.parametrize("backend, split", [("torch", False), (None, False), (None, True)])
def test_rows_written_into_out(backend, split, monkeypatch):
    # rows of a larger buffer, as check="batch" uses it; with `split`, complex goes to the torch
    # backend and the rest to the preferred one: two groups on one device fill one `out`
    if split:
        module, reason = dispatch._load("cpu")
        if reason is not None:
            pytest.skip(f"the cpu backend is unavailable: {reason}")
        monkeypatch.setattr(module, "supports", lambda t: t.device.type == "cpu" and not t.dtype.is_complex)
        monkeypatch.setattr(dispatch, "_choices", {})
    buffer = torch.full((6, 8), -1, dtype=torch.int64)
    tensors = [torch.tensor([1.0, -4.0]), torch.zeros(0), torch.tensor([3 + 4j]), torch.tensor([-7], dtype=torch.int8)]
    batch = tensor_stats(tensors, backend, out=buffer[1:5])
    assert batch.values.data_ptr() == buffer[1].data_ptr()
    if split:  # the complex tensor really took the other backend
        key = (torch.device("cpu"), torch.complex64)
        assert dispatch._choices[None][key].NAME == "torch"
    assert batch.tolist() == tensor_stats(tensors, "torch").tolist()
    assert (buffer[0] == -1).all() and (buffer[5] == -1).all()  # nothing outside the rows given


@pytest.mark.parametrize(
    "out, error, message",
    [
        ([0] * 8, TypeError, "out must be a tensor"),
        (torch.zeros(2, 8, dtype=torch.int32), ValueError, "int64"),
        (torch.zeros(3, 8, dtype=torch.int64), ValueError, r"shape \(2, 8\)"),
        (torch.zeros(8, 2, dtype=torch.int64).t(), ValueError, "contiguous"),
        (torch.zeros(2, 8, dtype=torch.int64, device="meta"), ValueError, "out is on meta"),
    ],
)
def test_bad_out_gets_a_clear_error(out, error, message):
    with pytest.raises(error, match=message):
        tensor_stats([torch.ones(2), torch.ones(3)], out=out)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex_by_parts_and_magnitude_without_overflow():
    # nan/inf by parts (torch.isnan/isinf, as the reference tests them); |z| in float64
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([3e38 + 3e38j, complex(inf, nan), complex(nan, 0.0), 1 + 0j], dtype=torch.complex64)
    (stats,) = tensor_stats([x[:1]], backend="torch").tolist()
    assert stats["posinf"] == 0 and stats["abs_max"] == math.hypot(float(x[0].real), float(x[0].imag))
    (stats,) = tensor_stats([x[1:2]], backend="torch").tolist()
    assert stats["nan"] == 1 and stats["posinf"] == 1 and stats["abs_max"] == inf
    (stats,) = tensor_stats([x[2:]], backend="torch").tolist()
    assert stats["nan"] == 1 and stats["posinf"] == 0 and math.isnan(stats["abs_max"])
    (stats,) = tensor_stats([torch.tensor([1.5e308 + 1.5e308j], dtype=torch.complex128)], backend="torch").tolist()
    assert stats["abs_max"] == inf and stats["posinf"] == 0  # the magnitude overflows float64 itself
    half = torch.tensor([65504 + 65504j, 2.0**-15], dtype=torch.complex32)
    (stats,) = tensor_stats([half], backend="torch").tolist()
    assert stats["posinf"] == 0 and stats["subnormal"] == 1 and stats["abs_max"] == math.hypot(65504.0, 65504.0)
    oracle.assert_stats_equal([stats], [half])


@pytest.mark.parametrize("dtype", oracle.FLOAT_DTYPES, ids=str)
def test_cpu_early_exit_matches_the_full_count(dtype):
    # On the CPU the torch backend reads abs-min/abs-max first and skips the counts they decide:
    # every combination of the branches (inf or not, zero or not, subnormal or not, NaN) against
    # the oracle and, bit for bit, against the path that counts everything.
    from overflow_fast.stats import torch_backend

    values = oracle.special_values(dtype)
    generator = torch.Generator().manual_seed(7)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]

    def cat(parts):  # through same-width integers: float8 has no CPU cat or flip
        return torch.cat([p.view(width) for p in parts]).view(dtype)

    nan = torch.isnan(values.float())
    others = oracle.take(values, ~nan)  # every subset of the values but NaN: all the branches
    tensors = [oracle.take(others, [i for i in range(others.numel()) if mask >> i & 1])
               for mask in range(1, 1 << others.numel())]
    tensors += [cat([values, values]).view(width).flip(0).view(dtype), torch.zeros(5, dtype=dtype),
                oracle.random_bits(dtype, (4, 9), generator)[:, ::2]]
    nonan = [t for t in tensors if not torch.isnan(t.float()).any()]
    tensors += [cat([t, oracle.take(values, nan)]) for t in nonan[::37]]  # with NaN
    got = torch_backend.compute(tensors)
    full = torch.stack([torch_backend._row(t) for t in tensors])
    assert torch.equal(got, full)
    oracle.assert_stats_equal(tensor_stats(tensors, backend="torch").tolist(), tensors, str(dtype))
