"""The engine as torch ops: overflow_fast::tensor_stats(_out) (C++, CPU) and
overflow_fast::tensor_stats_triton(_out) (Triton): torch.library.opcheck, the same rows as the
oracle and the torch backend, fake implementations under FakeTensorMode, profiler names, and
torch.compile(fullgraph=True) through the op and through tensor_stats.

The Triton ops run through Triton's interpreter in a child process (TRITON_INTERPRET=1 must be set
before the backend module is imported), as in test_triton_backend.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oracle import assert_stats_equal, random_bits, same_stats, special_values
from overflow_fast import tensor_stats
from overflow_fast.stats import cpu_backend, ops, torch_backend
from overflow_fast.stats.layout import decode_row

needs_cpu_ops = pytest.mark.skipif(
    not ops.HAVE_CPU_OPS, reason=f"C++ extension unavailable: {cpu_backend.unavailable_reason()}")

OP = torch.ops.overflow_fast.tensor_stats if ops.HAVE_CPU_OPS else None
OUT = torch.ops.overflow_fast.tensor_stats_out if ops.HAVE_CPU_OPS else None
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _lists():
    """Tensor lists for opcheck: mixed dtypes, empty tensors, 0-dim, non-contiguous layouts."""
    gen = _gen(0)
    base = torch.randn(6, 10, generator=gen)
    base[1, 3] = float("nan")
    base[4, 7] = float("-inf")
    return {
        # (no float8: opcheck's schema check compares inputs with ops torch lacks for float8)
        "mixed dtypes": [random_bits(d, (17,), gen) for d in (torch.float32, torch.float16, torch.bfloat16,
                                                              torch.float64, torch.int8, torch.int64,
                                                              torch.uint8, torch.bool)],
        "specials": [special_values(torch.float32), special_values(torch.float16), special_values(torch.int32)],
        "empty": [torch.empty(0), torch.empty(3, 0, dtype=torch.float16), torch.ones(2)],
        "0-dim": [torch.tensor(3.5), torch.tensor(-7, dtype=torch.int16), torch.tensor(float("nan"))],
        "non-contiguous": [base.t(), base[:, ::3], base[1:4, 2:9], base[2].expand(4, 10), base.reshape(-1)[1:]],
        "float8": [random_bits(torch.float8_e4m3fn, (9,), gen), random_bits(torch.float8_e5m2, (9,), gen)],
        "complex": [torch.tensor([1 + 2j, float("inf") - 1j], dtype=torch.complex64)],
        "requires grad": [torch.randn(5, generator=gen, requires_grad=True), torch.randn(2, 3, generator=gen)],
    }


def _decoded(rows, tensors):
    return [decode_row(row, t.dtype) for row, t in zip(rows.tolist(), tensors)]


@needs_cpu_ops
def test_schemas():
    assert str(OP.default._schema) == "overflow_fast::tensor_stats(Tensor[] tensors) -> Tensor"
    assert str(OUT.default._schema) == "overflow_fast::tensor_stats_out(Tensor[] tensors, Tensor(a!) out) -> ()"
    triton = torch.ops.overflow_fast
    assert str(triton.tensor_stats_triton.default._schema) == \
        "overflow_fast::tensor_stats_triton(Tensor[] tensors) -> Tensor"
    assert str(triton.tensor_stats_triton_out.default._schema) == \
        "overflow_fast::tensor_stats_triton_out(Tensor[] tensors, Tensor(a1!) out) -> ()"
    assert str(triton.read_into.default._schema) == \
        "overflow_fast::read_into(Tensor[] tensors, Tensor(a1!) rows, SymInt first) -> ()"


@needs_cpu_ops
@pytest.mark.parametrize("name", list(_lists()))
def test_opcheck_cpu_op(name):
    tensors = _lists()[name]
    if name == "float8":
        pytest.skip("opcheck's test_schema cannot compare float8 inputs (torch has no float8 mul on CPU)")
    utils = ALL_UTILS if any(t.requires_grad for t in tensors) else \
        tuple(u for u in ALL_UTILS if u != "test_autograd_registration")
    result = torch.library.opcheck(OP.default, (tensors,), test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, result
    out = torch.full((len(tensors), 8), -1, dtype=torch.int64)
    result = torch.library.opcheck(OUT.default, (tensors, out), test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, result


@needs_cpu_ops
def test_opcheck_cpu_op_no_tensors():
    result = torch.library.opcheck(OP.default, ([],), test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result
    assert OP([]).shape == (0, 8)


@needs_cpu_ops
@pytest.mark.parametrize("name", list(_lists()))
def test_cpu_op_rows_equal_oracle_and_torch_backend(name):
    tensors = _lists()[name]
    got = _decoded(OP(tensors), tensors)
    assert_stats_equal(got, tensors, name)
    for g, w in zip(got, _decoded(torch_backend.compute(tensors), tensors)):
        assert same_stats(g, w), (name, g, w)
    # the out variant writes the same rows into the caller's buffer and returns it
    buffer = torch.full((len(tensors) + 2, 8), -1, dtype=torch.int64)
    assert OUT(tensors, buffer[1:-1]) is None
    assert torch.equal(buffer[1:-1], OP(tensors)) and (buffer[0] == -1).all() and (buffer[-1] == -1).all()
    # and so does the pybind entry point
    assert torch.equal(cpu_backend.compute(tensors), OP(tensors))


@needs_cpu_ops
def test_cpu_op_keeps_the_binding_checks():
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU int64 tensor"):
        OUT([x], torch.zeros(2, 8, dtype=torch.int64))
    rows = torch.ones(1, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"out overlaps the memory of tensors\[0\]"):
        OUT([rows], rows)
    # a meta tensor gets the fake implementation: meta rows, nothing read
    rows = OP([torch.ones(3, device="meta")])
    assert rows.device.type == "meta" and rows.shape == (1, 8)


@needs_cpu_ops
def test_out_variant_bumps_the_version_counter():
    out = torch.zeros(1, 8, dtype=torch.int64)
    before = out._version
    OUT([torch.ones(2)], out)
    assert out._version > before


@needs_cpu_ops
def test_fake_implementations():
    with FakeTensorMode():
        tensors = [torch.ones(3), torch.zeros(2, 5, dtype=torch.float16), torch.empty(0, dtype=torch.int8)]
        rows = OP(tensors)
        assert rows.shape == (3, 8) and rows.dtype == torch.int64 and rows.device.type == "cpu"
        out = torch.empty(3, 8, dtype=torch.int64)
        OUT(tensors, out)
        rows = torch.ops.overflow_fast.tensor_stats_triton(tensors)
        assert rows.shape == (3, 8) and rows.dtype == torch.int64
        torch.ops.overflow_fast.tensor_stats_triton_out(tensors, out)
    # on another device the fake rows are on that device (what a traced CUDA model sees)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        meta = mode.from_tensor(torch.empty(4, 4, device="meta"))
        assert torch.ops.overflow_fast.tensor_stats_triton([meta]).device.type == "meta"


@needs_cpu_ops
def test_profiler_shows_the_op_by_name():
    x = [torch.randn(100), torch.randn(3, 3).half()]
    buffer = torch.empty(2, 8, dtype=torch.int64)
    calls = [
        (lambda: tensor_stats(x, backend="cpu"), "overflow_fast::tensor_stats"),  # the pybind entry point
        (lambda: tensor_stats(x, out=buffer), "overflow_fast::tensor_stats_out"),
        (lambda: OP(x), "overflow_fast::tensor_stats"),  # the op through the dispatcher
        (lambda: OUT(x, buffer), "overflow_fast::tensor_stats_out"),
    ]
    for call, name in calls:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        names = [event.name for event in prof.events()]
        assert name in names, (name, names)


@needs_cpu_ops
def test_compile_fullgraph_calls_the_op():
    def f(a, b):
        y = torch.relu(a) * 2
        out = torch.empty(2, 8, dtype=torch.int64)
        OUT([a, b], out)
        return y + 1, OP([a, y, b]), out

    a = torch.tensor([1.0, float("nan"), -3.0, 0.0, 1e-40])
    b = torch.arange(-3, 5, dtype=torch.int32)
    eager = f(a, b)
    compiled = torch.compile(f, fullgraph=True, backend="inductor")(a, b)
    for e, c in zip(eager, compiled):
        assert torch.equal(e.view(torch.int64) if e.dtype == torch.int64 else e.nan_to_num(), 
                           c.view(torch.int64) if c.dtype == torch.int64 else c.nan_to_num())


@needs_cpu_ops
def test_compile_fullgraph_through_tensor_stats():
    """tensor_stats traced by torch.compile becomes one op node: no graph break, the same rows."""
    def f(a, b):
        y = a * 2
        batch = tensor_stats([a, y, b])
        return y + 1, batch.values

    a = torch.tensor([1.0, float("nan"), -3.0, float("inf")])
    b = torch.arange(5, dtype=torch.int32)
    explanation = torch._dynamo.explain(f)(a, b)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert any("overflow_fast.tensor_stats" in str(op) for ops_ in explanation.ops_per_graph for op in ops_)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(a, b)
    assert torch.equal(compiled[1], f(a, b)[1]) and torch.equal(compiled[1], tensor_stats([a, a * 2, b]).values)

    def g(a, buffer):
        tensor_stats([a, a + 1], out=buffer[1:3])
        return buffer

    buffer = torch.full((4, 8), -1, dtype=torch.int64)
    got = torch.compile(g, fullgraph=True)(a, buffer.clone())
    want = g(a, buffer.clone())
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# The Triton ops, through the interpreter in a child process.

_TRITON_CHILD = r'''
import torch
from overflow_fast.stats import ops, triton_backend as tb, triton_common, torch_backend
assert triton_common._INTERPRET and tb.unavailable_reason() is None
op = torch.ops.overflow_fast.tensor_stats_triton
op_out = torch.ops.overflow_fast.tensor_stats_triton_out
base = torch.randn(6, 10)
base[1, 3] = float("nan")
lists = {
    "mixed": [torch.tensor([1.5, float("nan"), -float("inf")]), torch.arange(-4, 9, dtype=torch.int8),
              torch.randn(40).half(), torch.tensor([True, False])],
    "empty and 0-dim": [torch.empty(0), torch.tensor(2.5), torch.empty(2, 0, dtype=torch.int32)],
    "non-contiguous": [base.t(), base[:, ::3], base[2].expand(3, 10)],
}
utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
for name, tensors in lists.items():
    result = torch.library.opcheck(op.default, (tensors,), test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, (name, result)
    out = torch.full((len(tensors), 8), -1, dtype=torch.int64)
    result = torch.library.opcheck(op_out.default, (tensors, out), test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, (name, result)
    want = torch_backend.compute(tensors)
    got = op(tensors)
    # NaN rows: the torch backend may write another NaN payload; compare the NaN-free columns
    assert torch.equal(got[:, 2:], want[:, 2:]), (name, got, want)
    nan = got[:, 2] > 0
    assert torch.equal(got[~nan], want[~nan]), (name, got, want)
    op_out(tensors, out)
    assert torch.equal(out, got), name

# the per-hook read: opcheck, then inside a fullgraph compile, the rows buffer mutated in place
read = torch.ops.overflow_fast.read_into
for name, tensors in lists.items():
    rows = torch.full((len(tensors) + 3, 8), -1, dtype=torch.int64)
    result = torch.library.opcheck(read.default, (tensors, rows, 2), test_utils=utils)
    assert set(result.values()) == {"SUCCESS"}, (name, result)
    rows.fill_(-1)
    read(tensors, rows, 2)
    assert torch.equal(rows[2:2 + len(tensors)], op(tensors)) and (rows[:2] == -1).all(), name
try:
    read([torch.ones(2)], torch.empty(1, 8, dtype=torch.int64), 1)
except ValueError as error:
    assert "room for 1 rows from row 1" in str(error)
else:
    raise AssertionError("no room: should raise")

import torch._dynamo as dynamo
from torch._dynamo.utils import counters


def step(x, rows):
    h = torch.relu(x) * 2
    read([x, h], rows, 0)
    y = h.sum(dim=0)
    read([y], rows, 2)
    return y + 1


for backend in ("aot_eager", "inductor"):
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for batch in range(3):
        x = torch.randn(5, 7)
        x[batch, 1] = float("inf")
        rows = torch.full((4, 8), -1, dtype=torch.int64)
        out = compiled(x, rows)
        h = torch.relu(x) * 2
        assert torch.equal(rows[:3], op([x, h, h.sum(dim=0)])), (backend, batch, rows)
        assert (rows[3] == -1).all() and rows[0, 3] == 1
    assert counters["stats"]["unique_graphs"] == 1, (backend, dict(counters["stats"]))
explained = dynamo.explain(step)(torch.randn(5, 7), torch.zeros(4, 8, dtype=torch.int64))
assert explained.graph_break_count == 0 and explained.graph_count == 1
print("TRITON OPS OK")
'''


@pytest.mark.slow  # every op through Triton's interpreter; .ci/run runs it
def test_triton_ops_under_the_interpreter():
    from overflow_fast.stats import triton_common

    if triton_common.triton is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_TRITON_CHILD)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "TRITON OPS OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
