"""Every kind of tensor a training job hands the detector.

Tensor subclasses (``__torch_dispatch__`` wrappers, DTensor, FakeTensor, ``__torch_function__``
subclasses, Parameters), meta and inference tensors, views, jagged and strided nested tensors,
sparse tensors and complex32 must never crash ``tensor_stats`` or the detector; whatever holds
readable values gets the float64 oracle's numbers, and a nan/inf in it is detected wherever the
reference detects it. Complex overflow is judged by parts, as torch.isnan/isinf (and the
reference) do: a finite complex64 whose magnitude exceeds float32 is no false alarm.

A bug in this area can kill the interpreter (a wrapper subclass read through a null pointer), so
each test body runs in a child interpreter: all selected bodies in one child, one after another;
if the child dies, the test that was running fails with the signal and the rest continue in a
new child. Set ``OVERFLOW_FAST_TEST_IN_PROCESS=1`` to run the bodies in the pytest process
(plain tracebacks and hypothesis reports, but a segfault ends the run).
"""

import contextlib
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import traceback

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import oracle
from compat import ReferenceDetector, forward, run
from oracle import reference_stats, same_stats
from transformers.debug_utils import detect_overflow as reference_detect_overflow

import overflow_fast
from overflow_fast import DebugUnderflowOverflow, detect_overflow, tensor_stats
from overflow_fast._compat import dtensor_api

INF, NAN = float("inf"), float("nan")
OVERFLOW = (
    "ValueError",
    "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
    "Please scroll up above this traceback to see the activation values prior to this event.",
)
UNREADABLE_LINE = re.compile(r"^ {7}unreadable (\S+) \((.+)\)$")
CHECKS = ("module", "batch")
BACKENDS = (None, "torch")


# -- running each body in a child interpreter ------------------------------------------------

_IN_PROCESS = os.environ.get("OVERFLOW_FAST_TEST_IN_PROCESS") == "1"
_CHILD_TIMEOUT_S = 600
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_MODULE = os.path.splitext(os.path.basename(__file__))[0]
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(overflow_fast.__file__)))
CASES = {}  # key -> (body, args)


def isolated(params=None, ids=None):
    """Make ``body`` a test that runs in the child interpreter (once per entry of ``params``)."""

    def wrap(body):
        name = body.__name__
        if params is None:
            CASES[name] = (body, ())

            def test(isolated_case):
                isolated_case(name)
        else:
            labels = list(ids) if ids is not None else [str(i) for i in range(len(params))]
            keys = []
            for label, args in zip(labels, params):
                key = f"{name}[{label}]"
                CASES[key] = (body, args if isinstance(args, tuple) else (args,))
                keys.append(key)

            @pytest.mark.parametrize("case", keys, ids=labels)
            def test(case, isolated_case):
                isolated_case(case)

        test.__name__ = test.__qualname__ = name
        test.__doc__ = body.__doc__
        return test

    return wrap


def _child_main(path, keys):
    """Run the bodies ``keys`` one after another, logging each start and result to ``path``."""
    with open(path, "a") as log:
        for key in keys:
            log.write(json.dumps({"start": key}) + "\n")
            log.flush()
            body, args = CASES[key]
            try:
                body(*args)
                record = {"key": key, "ok": True}
            except pytest.skip.Exception as skipped:
                record = {"key": key, "skip": str(skipped.msg)}
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                record = {"key": key, "ok": False, "error": "".join(traceback.format_exception(error))}
            log.write(json.dumps(record) + "\n")
            log.flush()


def _death(returncode):
    if isinstance(returncode, int) and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _run_children(keys):
    results = {}
    pending = list(keys)
    while pending:
        fd, path = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        code = (f"import sys; sys.path[:0] = [{_PACKAGE_ROOT!r}, {_TESTS_DIR!r}]; "
                f"import {_MODULE} as m; m._child_main({path!r}, {pending!r})")
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=_CHILD_TIMEOUT_S)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as error:
            returncode = f"timeout after {_CHILD_TIMEOUT_S} s"
            output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                             for x in (error.stdout, error.stderr))
        started = None
        with open(path) as log:
            for line in log:
                if not line.endswith("\n"):
                    break
                record = json.loads(line)
                if "start" in record:
                    started = record["start"]
                else:
                    results[record["key"]] = record
                    started = None
        os.unlink(path)
        tail = output[-6000:]
        if started is not None:
            results[started] = {"key": started, "ok": False,
                                "error": f"the child interpreter died in this test ({_death(returncode)}); "
                                         f"its output ended with:\n{tail}"}
        elif any(key not in results for key in pending):
            for key in pending:  # it died before running anything: an import error
                results.setdefault(key, {"key": key, "ok": False,
                                         "error": f"the child interpreter failed ({_death(returncode)}):\n{tail}"})
        pending = [key for key in pending if key not in results]
    return results


@pytest.fixture(scope="module")
def isolated_case(request):
    if _IN_PROCESS:
        def run_here(key):
            body, args = CASES[key]
            body(*args)

        return run_here
    module = sys.modules[__name__]
    selected = []
    for item in request.session.items:
        if getattr(item, "module", None) is module:
            callspec = getattr(item, "callspec", None)
            selected.append(callspec.params["case"] if callspec is not None and "case" in callspec.params
                            else item.originalname)
    results = {}

    def run_child(key):
        if key not in results:
            todo = [key] + [k for k in selected if k not in results and k != key]
            results.update(_run_children(todo))
        record = results[key]
        if "skip" in record:
            pytest.skip(record["skip"])
        if not record["ok"]:
            pytest.fail(f"{key} failed in the child interpreter:\n{record['error']}", pytrace=False)

    return run_child


# -- tensor kinds -----------------------------------------------------------------------------

class Wrapper(torch.Tensor):
    """The ``__torch_dispatch__`` wrapper (the DTensor / torchao pattern): no storage of its
    own; every op runs on the inner tensor and returns plain tensors, except ``detach``, which keeps
    the wrapper so that ``nn.Parameter`` accepts it (as DTensor's does)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def un(a):
            return a.inner if isinstance(a, Wrapper) else a

        out = func(*[un(a) for a in args], **{k: un(v) for k, v in (kwargs or {}).items()})
        return Wrapper(out) if func is torch.ops.aten.detach.default else out

    def __repr__(self):
        return f"Wrapper({self.inner!r})"


class OpaqueWrapper(torch.Tensor):
    """A wrapper whose ops return wrappers again (no torch op yields a plain tensor), like
    torchao's tensors: the engine may read it or call it unreadable, never crash on it."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(OpaqueWrapper, lambda a: a.inner, (args, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, OpaqueWrapper, func(*args, **kwargs))

    def __repr__(self):
        return f"OpaqueWrapper({self.inner!r})"


class BrokenWrapper(torch.Tensor):
    """A wrapper on which every op fails with a very long message."""

    MESSAGE = "this wrapper cannot run " + "any operator at all, " * 100

    @staticmethod
    def __new__(cls, shape, dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")

    def __init__(self, shape, dtype=torch.float32):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: {cls.MESSAGE}")

    def __repr__(self):
        return "BrokenWrapper()"


class TorchFunctionTensor(torch.Tensor):
    """A ``__torch_function__``-only subclass: it owns its memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class Passthrough(nn.Module):
    def forward(self, x):
        return x


class Returns(nn.Module):
    """Returns ``value`` (a tensor or a tuple) whatever its input."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value


class Holder(nn.Module):
    """Holds ``weight`` as its own parameter and returns its input."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x


def fake_tensor(x):
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(x)


# -- helpers ------------------------------------------------------------------------------------

def stats_of(tensors, backend=None):
    """``tensor_stats(...).tolist()``, checked to be the same when written into rows of a buffer
    (``out=``, as check="batch" uses it)."""
    tensors = list(tensors)
    rows = tensor_stats(tensors, backend).tolist()
    buffer = torch.full((len(tensors) + 2, 8), -1, dtype=torch.int64)
    into = tensor_stats(tensors, backend, out=buffer[1:-1]).tolist()
    assert len(into) == len(rows) and all(same_stats(a, b) for a, b in zip(into, rows)), \
        f"with out=: {into}; without: {rows}"
    assert (buffer[0] == -1).all() and (buffer[-1] == -1).all(), "out= wrote outside its rows"
    return rows


def assert_oracle(got, want, label):
    assert same_stats(got, want), f"{label}: got {got}, want {want}"


def ours(build, batches, check, **kwargs):
    out, outcomes, _ = run(DebugUnderflowOverflow, build(), batches, forward, check=check, **kwargs)
    return out, outcomes


def reference(build, batches, **kwargs):
    out, outcomes, _ = run(ReferenceDetector, build(), batches, forward, **kwargs)
    return out, outcomes


def reference_handles(outcomes):
    """The reference ran to its end or stopped with its own detection, not on an error of its own."""
    return all(outcome is None or outcome == OVERFLOW for outcome in outcomes)


def assert_same_as_reference(build, batches, **kwargs):
    """Ours prints exactly what the reference prints, in both check modes; returns the
    reference's capture."""
    want_out, want_outcomes = reference(build, batches, **kwargs)
    assert reference_handles(want_outcomes), f"the reference itself fails: {want_outcomes}\n{want_out}"
    for check in CHECKS:
        got_out, got_outcomes = ours(build, batches, check, **kwargs)
        assert got_outcomes == want_outcomes, f"check={check}: outcomes {got_outcomes}, want {want_outcomes}\n{got_out}"
        assert got_out == want_out, f"check={check}: {_first_difference(got_out, want_out)}"
    return want_out, want_outcomes


def _first_difference(got, want):
    got_lines, want_lines = got.splitlines(), want.splitlines()
    for i, (g, w) in enumerate(zip(got_lines, want_lines)):
        if g != w:
            return f"line {i}: got {g!r}, want {w!r}\n--- got:\n{got}\n--- want:\n{want}"
    return f"lengths differ: got {len(got_lines)} lines, want {len(want_lines)}\n--- got:\n{got}\n--- want:\n{want}"


def unreadable_lines(text):
    return [line for line in text.splitlines() if "unreadable" in line]


def assert_unreadable_line(text, ctx):
    lines = [line for line in unreadable_lines(text) if UNREADABLE_LINE.match(line) and
             UNREADABLE_LINE.match(line).group(1) == ctx]
    assert len(lines) >= 1, f"no `       unreadable {ctx} (<reason>)` line in:\n{text}"
    for line in unreadable_lines(text):
        assert UNREADABLE_LINE.match(line), f"malformed unreadable line {line!r}"
        assert len(line) <= 120, f"unreadable line of {len(line)} characters: {line!r}"


def captured(function, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = function(*args)
    return out.getvalue(), result


def has_overflow(stats):
    return bool(stats["nan"] or stats["posinf"] or stats["neginf"])


def special_matrix(dtype, rows=3):
    """The dtype's special values (nan, ±inf, ±0, subnormals, max finite) padded to ``rows`` rows."""
    values = oracle.special_values(dtype)
    pad = (-values.numel()) % rows
    if pad:
        values = torch.cat([values, values[:pad]])
    return values.reshape(rows, -1)


@contextlib.contextmanager
def world_of_one():
    """A gloo process group of world size 1 and its one-device CPU mesh, always torn down."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch is built without torch.distributed")
    from torch.distributed.device_mesh import DeviceMesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# == 1. tensor subclasses ========================================================================

_WRAPPER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2,
                   torch.float8_e4m3fn, torch.int32, torch.int8, torch.bool)


@isolated(params=BACKENDS, ids=["default", "torch"])
def test_dispatch_wrapper_numbers_equal_the_oracle(backend):
    """A ``__torch_dispatch__`` wrapper is read through torch ops: the inner tensor's numbers,
    alone, among plain tensors (several groups in one call) and over non-contiguous inners."""
    generator = torch.Generator().manual_seed(8)
    for dtype in _WRAPPER_DTYPES:
        inners = [oracle.special_values(dtype), oracle.random_bits(dtype, (4, 6), generator).t(),
                  oracle.random_bits(dtype, (5,), generator)[::2], torch.empty(0, 3, dtype=dtype),
                  oracle.random_bits(dtype, (), generator)]
        for inner in inners:
            (got,) = stats_of([Wrapper(inner)], backend)
            assert_oracle(got, reference_stats(inner), f"Wrapper({dtype}, {tuple(inner.shape)})")
        plain = oracle.random_bits(torch.float32, (7,), generator)
        mixed = [plain, Wrapper(inners[0]), inners[1], Wrapper(inners[1]), Wrapper(inners[2])]
        expected = [plain, inners[0], inners[1], inners[1], inners[2]]
        for i, (got, want) in enumerate(zip(stats_of(mixed, backend), expected)):
            assert_oracle(got, reference_stats(want), f"mixed list, tensor {i} ({dtype})")
    # a Parameter holding a wrapper (what FSDP2 and tensor parallelism make)
    inner = oracle.special_values(torch.bfloat16)
    parameter = nn.Parameter(Wrapper(inner))
    assert isinstance(parameter, Wrapper) and isinstance(parameter, nn.Parameter)
    (got,) = stats_of([parameter], backend)
    assert_oracle(got, reference_stats(inner), "Parameter(Wrapper)")


class _WrapOutput(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.value = value

    def forward(self, x):
        y = self.lin(x)
        if self.value is not None:
            y = y.clone()
            y[0, 1] = self.value
        return Wrapper(y)


class _WrapParameter(nn.Module):
    def __init__(self, value):
        super().__init__()
        weight = torch.linspace(-2, 3, 6).reshape(2, 3)
        if value is not None:
            weight[1, 2] = value
        self.weight = nn.Parameter(Wrapper(weight))

    def forward(self, x):
        return x + 1.0


@isolated(params=[None, NAN, INF, -INF], ids=["finite", "nan", "inf", "-inf"])
def test_dispatch_wrapper_in_the_detector_prints_what_the_reference_prints(value):
    """The reference reads a wrapper through ``abs().min()/max()``: same lines, same nan/inf
    lines, same ValueError, in both check modes (output and parameter wrappers; traced, so that
    every frame is printed, and untraced)."""
    batches = [torch.arange(6.0).reshape(2, 3) / 7]
    for module in (_WrapOutput, _WrapParameter):
        def build():
            torch.manual_seed(0)
            return nn.Sequential(module(value), nn.Identity())

        for kwargs in ({}, {"trace_batch_nums": [0]}):
            want_out, want_outcomes = assert_same_as_reference(build, batches * 2, **kwargs)
            if value is not None:
                ctx = "output" if module is _WrapOutput else "weight"
                assert f"{ctx} has {'nans' if value != value else 'infs'}" in want_out.splitlines()
                assert OVERFLOW in want_outcomes
            else:
                assert want_outcomes == [None, None]


def _dtensor_models(mesh, value, how):
    api = dtensor_api()
    Replicate, Shard, distribute_module, distribute_tensor = (
        api.Replicate, api.Shard, api.distribute_module, api.distribute_tensor)

    def plain():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        if value is not None:
            with torch.no_grad():
                model[0].weight[1, 2] = value
        return model

    def distributed():
        model = plain()
        if how == "shard":
            linear = model[0]
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
            linear.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Replicate()]))
        else:
            distribute_module(model, mesh)  # every parameter replicated
        return model

    return plain, distributed


@isolated()
def test_dtensor_at_world_size_one():
    """DTensor is read through its local shard: at world size 1, the full tensor's numbers
    (Shard and Replicate placements); ``detect_overflow`` answers as the reference's does; a nan
    in a DTensor parameter is detected in both check modes, with the report the reference prints
    for the same model of plain tensors (the reference itself cannot format a DTensor)."""
    api = dtensor_api()
    Replicate, Shard, distribute_tensor = api.Replicate, api.Shard, api.distribute_tensor

    with world_of_one() as mesh:
        generator = torch.Generator().manual_seed(3)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            full = [special_matrix(dtype), oracle.random_bits(dtype, (4, 6), generator)]
            for x in full:
                for placement in (Shard(0), Shard(1), Replicate()):
                    d = distribute_tensor(x, mesh, [placement])
                    for backend in BACKENDS:
                        (got,) = stats_of([d], backend)
                        assert_oracle(got, reference_stats(x), f"DTensor {dtype} {placement} backend={backend}")
                        got = stats_of([x[0], d, torch.ones(2)], backend)[1]
                        assert_oracle(got, reference_stats(x), f"DTensor among plain tensors {dtype} {placement}")
                    got_out, got_result = captured(detect_overflow, d, "d")
                    try:
                        want_out, want_result = captured(reference_detect_overflow, d, "d")
                    except NotImplementedError:  # torch before 2.5 has no DTensor rule for any()
                        want_out, want_result = captured(reference_detect_overflow, x, "d")
                    assert (got_out, got_result) == (want_out, want_result), f"detect_overflow of DTensor {dtype}"

        batches = [torch.tensor([[0.5, -1.0, 2.0]])]
        dtensor_batches = [distribute_tensor(b, mesh, [Replicate()]) for b in batches]
        for how in ("shard", "distribute_module"):
            for value in (None, NAN, INF):
                plain, distributed = _dtensor_models(mesh, value, how)
                want_out, want_outcomes = reference(plain, batches * 2, trace_batch_nums=[0])
                assert reference_handles(want_outcomes), want_outcomes
                for check in CHECKS:
                    got_out, got_outcomes = ours(distributed, dtensor_batches * 2, check, trace_batch_nums=[0])
                    label = f"{how} value={value} check={check}"
                    assert got_outcomes == want_outcomes, f"{label}: {got_outcomes}, want {want_outcomes}\n{got_out}"
                    assert got_out == want_out, f"{label}: {_first_difference(got_out, want_out)}"
                    if value is not None:
                        assert f"weight has {'nans' if value != value else 'infs'}" in got_out.splitlines()
                # untraced: the first bad module raises at once
                want_out, want_outcomes = reference(plain, batches)
                for check in CHECKS:
                    got_out, got_outcomes = ours(distributed, dtensor_batches, check)
                    label = f"{how} value={value} check={check} untraced"
                    assert got_outcomes == want_outcomes, f"{label}: {got_outcomes}, want {want_outcomes}\n{got_out}"
                    assert got_out == want_out, f"{label}: {_first_difference(got_out, want_out)}"
                    assert (OVERFLOW in got_outcomes) == (value is not None), label


@isolated()
def test_fake_and_meta_tensors_are_unreadable_and_the_detector_goes_on():
    """FakeTensor and meta tensors hold no data: ``tensor_stats`` raises a TypeError saying so;
    the detector prints ``       unreadable <ctx> (<reason>)`` for them, keeps going, and still
    catches a nan next to them."""
    fake = fake_tensor(torch.ones(2, 3))
    meta = torch.ones(2, 3, device="meta")
    for tensor in (fake, meta, fake_tensor(torch.ones(2, dtype=torch.bfloat16))):
        for backend in BACKENDS:
            with pytest.raises(TypeError, match="cannot be read"):
                tensor_stats([tensor], backend)
            with pytest.raises(TypeError, match="cannot be read"):
                tensor_stats([torch.ones(2), tensor], backend)

    x = torch.tensor([[1.0, -2.0]])
    for check in CHECKS:
        # a fake output: traced batches print the frame; no error
        out, outcomes = ours(lambda: nn.Sequential(Returns(fake), nn.Identity()), [x, x, x], check,
                             trace_batch_nums=[0, 1])
        assert outcomes == [None, None, None], (check, outcomes, out)
        assert_unreadable_line(out, "output")
        assert "1.00e+00 2.00e+00 input[0]" in out.splitlines()
        # a whole model on the meta device
        def meta_model():
            return nn.Sequential(nn.Linear(3, 2, device="meta"), nn.ReLU())

        out, outcomes = ours(meta_model, [torch.ones(1, 3, device="meta")] * 2, check, trace_batch_nums=[0, 1])
        assert outcomes == [None, None], (check, outcomes, out)
        for ctx in ("weight", "bias", "input[0]", "output"):
            assert_unreadable_line(out, ctx)
        # a nan beside a fake tensor is still caught, and the fake one keeps its line in the dump
        bad = torch.tensor([[1.0, NAN]])
        out, outcomes = ours(lambda: nn.Sequential(Returns((fake, bad)), nn.Identity()), [x], check)
        assert outcomes == [OVERFLOW], (check, outcomes, out)
        assert "output[1] has nans" in out.splitlines()
        assert_unreadable_line(out, "output[0]")


@isolated()
def test_storage_less_tensors_never_reach_the_kernel_unchecked():
    """Defence in depth: the C++ binding itself refuses a tensor without storage of its own
    (a wrapper subclass, FakeTensor, meta) with a Python exception instead of reading memory."""
    from overflow_fast.stats import cpu_backend

    if cpu_backend.unavailable_reason() is not None:
        pytest.skip(f"the C++ extension is unavailable: {cpu_backend.unavailable_reason()}")
    for tensor in (Wrapper(torch.ones(3)), fake_tensor(torch.ones(3)), torch.ones(3, device="meta"),
                   OpaqueWrapper(torch.ones(3))):
        with pytest.raises(Exception):
            cpu_backend._C.compute([torch.ones(2), tensor], None)


# -- the property test --------------------------------------------------------------------------

_KINDS = ("plain", "torch_function", "wrapper", "parameter", "wrapper_parameter", "inference", "opaque")
_VIEWS = ("none", "transpose", "slice", "offset", "expand", "neg", "scalar")


def _pool(dtype):
    """Special values and ordinary ones of ``dtype``, as a 1-D tensor to index."""
    ordinary = torch.tensor([0.5, -3.0, 1.25, 7.0, -0.0625]).to(dtype)
    return torch.cat([oracle.special_values(dtype), ordinary])


def _view(x, view):
    if view == "transpose":
        return x.t()
    if view == "slice":
        return x[:, ::2]
    if view == "offset":
        return x[x.shape[0] // 2:, 1:]
    if view == "expand":
        return x.reshape(-1)[:1].expand(3, 2)
    if view == "neg":
        return torch._neg_view(x)
    if view == "scalar":
        return x.reshape(-1)[-1]
    return x


@st.composite
def tensor_cases(draw):
    dtype = draw(st.sampled_from(oracle.FLOAT_DTYPES))
    pool = _pool(dtype)
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    indices = draw(st.lists(st.integers(0, pool.numel() - 1), min_size=rows * cols, max_size=rows * cols))
    views = [v for v in _VIEWS if not (v == "neg" and dtype in oracle.FLOAT8)]  # torch has no fp8 neg
    return {
        "dtype": dtype,
        "base": oracle.take(pool, torch.tensor(indices)).reshape(rows, cols),
        "view": draw(st.sampled_from(views)),
        "trace": draw(st.booleans()),
    }


def _make(case, kind):
    """(the tensor of the given kind, the plain tensor holding its values)."""
    base, view = case["base"], case["view"]
    if kind == "inference":
        with torch.inference_mode():
            tensor = _view(base.clone(), view)
        return tensor, _view(base, view)
    plain = _view(base, view)
    if kind in ("wrapper", "wrapper_parameter", "opaque") and plain.is_neg():
        # ops inside __torch_dispatch__ run below the Negative key, so a wrapper around a lazy
        # negation exposes the un-negated bits to every op (torch's behaviour, not ours): the
        # wrapper's values are those of the resolved tensor only once it is resolved
        plain = plain.resolve_neg()
    if kind == "torch_function":
        return _view(base.as_subclass(TorchFunctionTensor), view), plain
    if kind == "wrapper":
        return Wrapper(plain), plain
    if kind == "parameter":
        return nn.Parameter(plain), plain
    if kind == "wrapper_parameter":
        return nn.Parameter(Wrapper(plain)), plain
    if kind == "opaque":
        return OpaqueWrapper(plain), plain
    return plain, plain


def _check_kind(case, kind):
    tensor, plain = _make(case, kind)
    want = reference_stats(plain)
    label = f"{kind} {case['view']} {case['dtype']} {tuple(plain.shape)}"
    readable = True
    try:
        got = stats_of([tensor])
    except TypeError as error:
        # only a wrapper that no torch op can see through may be unreadable
        assert kind == "opaque" and "cannot be read" in str(error), f"{label}: {error}"
        readable = False
    if readable:
        assert_oracle(got[0], want, label)
        got = stats_of([torch.ones(3), tensor, torch.zeros(2, dtype=torch.float16)])
        assert_oracle(got[1], want, f"{label} among plain tensors")

    if kind in ("parameter", "wrapper_parameter"):
        def build():
            return nn.Sequential(Holder(tensor), nn.Identity())

        batches, contexts = [torch.ones(2)] * 2, ["weight"]
    else:
        def build():
            return nn.Sequential(Passthrough(), nn.Identity())

        batches, contexts = [tensor] * 2, ["input[0]", "output"]
    kwargs = {"trace_batch_nums": [0]} if case["trace"] else {}
    want_out, want_outcomes = reference(build, batches, **kwargs)
    bad = readable and has_overflow(want)
    for check_mode in CHECKS:
        got_out, got_outcomes = ours(build, batches, check_mode, **kwargs)
        where = f"{label} check={check_mode} trace={case['trace']}"
        assert all(o is None or o == OVERFLOW for o in got_outcomes), f"{where}: {got_outcomes}\n{got_out}"
        assert (OVERFLOW in got_outcomes) == bad, f"{where}: {got_outcomes}, want a detection: {bad}\n{got_out}"
        lines = got_out.splitlines()
        for ctx in contexts:
            assert (f"{ctx} has nans" in lines) == (readable and want["nan"] > 0), f"{where}\n{got_out}"
            assert (f"{ctx} has infs" in lines) == (readable and want["posinf"] + want["neginf"] > 0), \
                f"{where}\n{got_out}"
        if reference_handles(want_outcomes):
            assert got_outcomes == want_outcomes, f"{where}: {got_outcomes}, want {want_outcomes}"
            assert got_out == want_out, f"{where}: {_first_difference(got_out, want_out)}"
        for line in unreadable_lines(got_out):
            assert UNREADABLE_LINE.match(line) and len(line) <= 120, f"{where}: {line!r}"


@isolated()
def test_random_tensor_kinds_never_crash_and_get_the_oracle_numbers():
    """Random float dtypes holding random special values, in random views, each as every kind
    (plain, ``__torch_function__`` and ``__torch_dispatch__`` subclasses, Parameters, inference
    tensors): the oracle's numbers from ``tensor_stats``; in both check modes never an error but
    the reference's ValueError, a detection exactly when there is a nan/inf, and the reference's
    very text wherever the reference can handle the tensor."""

    @settings(max_examples=30, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(tensor_cases())
    def check(case):
        for kind in _KINDS:
            _check_kind(case, kind)

    check()


# == 3. silently missed detections ==================================================================

def _jagged_cases():
    a = torch.tensor([1.0, NAN, -2.5])
    b = torch.tensor([0.0, -3.0])
    cases = [("1-d", [a, b]), ("inf", [torch.tensor([INF, 2.0]), torch.tensor([-0.0])]),
             ("2-d", [torch.arange(6.0).reshape(2, 3) - 2, torch.tensor([[-INF, 1e-40, 3.0]])])]
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        values = oracle.special_values(dtype)
        cases.append((str(dtype), [values[:4], values[4:]]))
    cases.append(("int64", [torch.tensor([1, -7]), torch.tensor([0, 3, -(2**63)])]))
    return cases


@isolated(params=BACKENDS, ids=["default", "torch"])
def test_jagged_nested_tensor_numbers_are_those_of_all_its_elements(backend):
    """A jagged nested tensor: the statistics of all its elements (the oracle of the components'
    concatenation), contiguous or not. A narrowed one does not count the values buffer's
    elements outside its components."""
    for label, components in _jagged_cases():
        nt = torch.nested.nested_tensor(components, layout=torch.jagged)
        assert nt.layout == torch.jagged
        want = reference_stats(torch.cat([c.reshape(-1) for c in components]))
        (got,) = stats_of([nt], backend)
        assert_oracle(got, want, f"jagged {label}")
        got = stats_of([torch.ones(2), nt], backend)[1]
        assert_oracle(got, want, f"jagged {label} among plain tensors")
    # 3-d jagged, transposed: not contiguous, the same elements
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.tensor([[1.0, INF, -0.0]])], layout=torch.jagged)
    transposed = nt.transpose(1, 2)
    assert not transposed.is_contiguous()
    (got,) = stats_of([transposed], backend)
    assert_oracle(got, reference_stats(torch.cat([c.reshape(-1) for c in nt.unbind()])), "transposed jagged")
    # narrowed: the buffer holds values (nan and inf here) that are no element of the tensor
    buffer = torch.arange(12.0).reshape(3, 4) - 5
    buffer[0, 3], buffer[1, 0], buffer[2, 0] = NAN, INF, 0.0
    narrowed = torch.nested.narrow(buffer, 1, torch.tensor([0, 1, 2]), torch.tensor([2, 1, 2]),
                                   layout=torch.jagged)
    components = [c.reshape(-1) for c in narrowed.unbind()]
    assert torch.cat(components).tolist() == [-5.0, -4.0, 0.0, 5.0, 6.0]
    (got,) = stats_of([narrowed], backend)
    assert_oracle(got, reference_stats(torch.cat(components)), "narrowed jagged")


class _JaggedOutput(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        second = x[:1] * 2
        if self.value is not None:
            second = second.clone()
            second[0] = self.value
        return torch.nested.nested_tensor([x, second], layout=torch.jagged)


@isolated(params=[None, NAN, INF], ids=["finite", "nan", "inf"])
def test_jagged_nested_tensor_in_the_detector(value):
    """A nan/inf in a jagged nested tensor is detected: ours prints what the reference prints
    (it reads jagged tensors through abs().min()/max()), in both check modes."""
    batches = [torch.tensor([0.5, -1.5, 3.0])]
    try:
        torch.nested.nested_tensor([batches[0]], layout=torch.jagged).abs().min()
    except NotImplementedError:  # torch before 2.5
        pytest.skip("this torch has no min() of a jagged tensor: the reference cannot read one")

    def build():
        return nn.Sequential(_JaggedOutput(value), nn.Identity())

    for kwargs in ({}, {"trace_batch_nums": [0]}):
        want_out, want_outcomes = assert_same_as_reference(build, batches * 2, **kwargs)
        assert (OVERFLOW in want_outcomes) == (value is not None)


@isolated()
def test_narrowed_jagged_tensor_raises_no_false_alarm():
    """A deliberate difference: the reference reads a narrowed jagged tensor's whole values
    buffer (its abs() runs on the buffer) and reports a nan that is no element of the tensor;
    ours checks the elements only."""
    buffer = torch.arange(12.0).reshape(3, 4) - 5
    buffer[0, 3], buffer[1, 0] = NAN, INF
    narrowed = torch.nested.narrow(buffer, 1, torch.tensor([0, 1, 2]), torch.tensor([2, 1, 2]),
                                   layout=torch.jagged)

    def build():
        return nn.Sequential(Returns(narrowed), nn.Identity())

    for check in CHECKS:
        out, outcomes = ours(build, [torch.ones(2)] * 2, check, trace_batch_nums=[0])
        assert outcomes == [None, None], (check, outcomes, out)
        assert "has nans" not in out and "has infs" not in out, out
        assert "0.00e+00 6.00e+00 output" in out.splitlines(), out
    out, result = captured(detect_overflow, narrowed, "n")
    assert (out, result) == ("", False)


_COMPLEX32_VALUES = [3 + 4j, -1.5 - 2j, 0j, 5 - 12j, 65504 + 0j, 2j, -0.0 + 0j]


@isolated(params=BACKENDS, ids=["default", "torch"])
def test_complex32_numbers_are_those_of_its_complex64_widening(backend):
    """complex32 is read (widened or natively): the oracle of its exact complex64 widening.
    (Magnitudes here are exact in float64 and above float16's smallest normal.)"""
    finite = torch.tensor(_COMPLEX32_VALUES, dtype=torch.complex64).to(torch.complex32)
    cases = [finite, finite.reshape(7, 1).t(), finite[::2], torch.empty(0, dtype=torch.complex32),
             torch.tensor([3 + 4j, complex(NAN, 1.0), complex(1.0, INF)], dtype=torch.complex64).to(torch.complex32),
             torch.tensor([complex(-INF, 0.0), 6 + 8j], dtype=torch.complex64).to(torch.complex32)]
    for c in cases:
        assert c.dtype == torch.complex32
        (got,) = stats_of([c], backend)
        assert_oracle(got, reference_stats(c.to(torch.complex64)), f"complex32 {c.to(torch.complex64).tolist()}")
        wide = c.to(torch.complex64)
        assert got["nan"] == int(torch.isnan(wide).sum()), got
        assert got["posinf"] + got["neginf"] == int(torch.isinf(wide).sum()), got
    got = stats_of([torch.ones(2), finite, torch.tensor([1 + 1j])], backend)[1]
    assert_oracle(got, reference_stats(finite.to(torch.complex64)), "complex32 among other tensors")
    assert got["abs_min"] == 0.0 and got["abs_max"] == 65504.0 and got["zero"] == 2


@isolated(params=[None, complex(NAN, 0.0), complex(INF, 0.0), complex(0.0, -INF)],
          ids=["finite", "nan", "inf", "-inf-imag"])
def test_complex32_in_the_detector(value):
    """A nan/inf in a complex32 tensor is detected, and ours prints what the reference prints."""
    values = [3 + 4j, -6 - 8j] + ([value] if value is not None else [])
    c = torch.tensor(values, dtype=torch.complex64).to(torch.complex32)

    def build():
        return nn.Sequential(Returns(c), nn.Identity())

    for kwargs in ({}, {"trace_batch_nums": [0]}):
        want_out, want_outcomes = assert_same_as_reference(build, [torch.ones(2)] * 2, **kwargs)
        assert (OVERFLOW in want_outcomes) == (value is not None)
    got = captured(detect_overflow, c, "c")
    assert got == captured(reference_detect_overflow, c, "c")


@isolated()
def test_complex_overflow_of_the_magnitude_is_no_false_alarm():
    """complex64 3e38+3e38j has finite parts: no nan, no inf (torch.isinf and the reference say
    so); its magnitude, computed in float64, is 4.24e+38. The detector does not raise, in
    either check mode, and ``detect_overflow`` answers as the reference's does."""
    part = float(torch.tensor(3e38, dtype=torch.float32))
    big = torch.tensor([complex(3e38, 3e38), 1 + 1j], dtype=torch.complex64)
    (got,) = stats_of([big])
    assert (got["nan"], got["posinf"], got["neginf"]) == (0, 0, 0), got
    assert math.isclose(got["abs_max"], math.hypot(part, part), rel_tol=1e-15), got
    assert math.isclose(got["abs_min"], math.sqrt(2), rel_tol=1e-15), got
    assert got["numel"] == 2 and got["zero"] == 0

    # complex128 whose magnitude overflows float64: the parts are finite all the same
    huge = torch.tensor([complex(1.5e308, 1.5e308), 2j], dtype=torch.complex128)
    (got,) = stats_of([huge])
    assert (got["nan"], got["posinf"], got["neginf"]) == (0, 0, 0), got

    for tensor in (big, huge, big.reshape(2, 1).t()):
        def build():
            return nn.Sequential(Returns(tensor), nn.Identity())

        want_out, want_outcomes = reference(build, [torch.ones(2)] * 2)
        assert want_outcomes == [None, None], want_outcomes  # the reference does not raise either
        for check in CHECKS:
            for kwargs in ({}, {"trace_batch_nums": [0]}):
                out, outcomes = ours(build, [torch.ones(2)] * 2, check, **kwargs)
                assert outcomes == [None, None], (check, kwargs, outcomes, out)
                assert "has infs" not in out and "has nans" not in out, out
        assert captured(detect_overflow, tensor, "c") == captured(reference_detect_overflow, tensor, "c") == ("", False)
    out, _ = ours(lambda: nn.Sequential(Returns(big), nn.Identity()), [torch.ones(2)], "module",
                  trace_batch_nums=[0])
    assert "1.41e+00 4.24e+38 output" in out.splitlines(), out


@isolated()
def test_complex_nan_and_inf_are_counted_by_parts():
    """As torch.isnan/isinf (and so the reference) see them: an element is a nan if a part is
    nan, an inf if a part is infinite; ``detect_overflow`` prints the reference's lines."""
    specials = [complex(INF, NAN), complex(NAN, 1.0), complex(1.0, -INF), complex(-INF, -INF),
                complex(NAN, NAN), complex(0.0, 0.0), complex(3e38, -3e38), complex(-2.0, 5.0)]
    for dtype in (torch.complex64, torch.complex128, torch.complex32):
        wide = torch.tensor(specials, dtype=torch.complex128).to(torch.complex64 if dtype == torch.complex32 else dtype)
        c = wide.to(dtype)
        (got,) = stats_of([c])
        assert got["nan"] == int(torch.isnan(c).sum()), (dtype, got)
        assert got["posinf"] + got["neginf"] == int(torch.isinf(c).sum()), (dtype, got)
        for i in range(len(specials)):
            element = c[i:i + 1]
            assert captured(detect_overflow, element, "x") == captured(reference_detect_overflow, element, "x"), \
                (dtype, specials[i])
            (got,) = stats_of([element])
            assert got["nan"] == int(torch.isnan(element).sum()), (dtype, specials[i], got)
            assert got["posinf"] + got["neginf"] == int(torch.isinf(element).sum()), (dtype, specials[i], got)


def _sparse_cases():
    """(label, sparse tensor, its dense equivalent)."""
    x = torch.tensor([[0.0, 2.0, 0.0, -INF], [0.0, 0.0, 1e-40, 0.0], [-0.5, 0.0, 0.0, 3.0]])
    full = torch.tensor([[1.0, -2.0], [INF, 0.25]])  # no implicit zeros
    with_nan = torch.tensor([[0.0, NAN], [4.0, 0.0]])
    cases = []
    for label, dense in (("zeros", x), ("full", full), ("nan", with_nan), ("empty", torch.zeros(0, 3)),
                         ("all-implicit", torch.zeros(2, 3))):
        cases.append((f"coo {label}", dense.to_sparse(), dense))
        cases.append((f"csr {label}", dense.to_sparse_csr(), dense))
        cases.append((f"csc {label}", dense.to_sparse_csc(), dense))
    cases.append(("coo hybrid", x.to_sparse(1), x))
    cases.append(("bsr", torch.cat([x, torch.zeros(1, 4)]).to_sparse_bsr((2, 2)), torch.cat([x, torch.zeros(1, 4)])))
    # uncoalesced: duplicate entries add up in the dense tensor
    indices = torch.tensor([[0, 0, 2, 1], [1, 1, 0, 2]])
    uncoalesced = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, INF, -0.25]), (3, 3))
    assert not uncoalesced.is_coalesced()
    cases.append(("coo uncoalesced", uncoalesced, uncoalesced.to_dense()))
    cancelling = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1]]), torch.tensor([1.5, -1.5, 2.0]), (4,))
    cases.append(("coo uncoalesced to zero", cancelling, cancelling.to_dense()))
    explicit_zero = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([0.0, 5.0]), (3,))
    cases.append(("coo stored zero", explicit_zero, explicit_zero.to_dense()))
    cases.append(("coo float16", x.half().to_sparse(), x.half()))
    cases.append(("coo int32", torch.tensor([[0, -7], [3, 0]], dtype=torch.int32).to_sparse(),
                  torch.tensor([[0, -7], [3, 0]], dtype=torch.int32)))
    return cases


@isolated(params=BACKENDS, ids=["default", "torch"])
def test_sparse_numbers_are_those_of_the_dense_tensor(backend):
    """Sparse COO (coalesced or not, hybrid), CSR, CSC and BSR tensors: the statistics of the
    dense tensor (implicit zeros are zeros, numel is the dense numel)."""
    for label, sparse, dense in _sparse_cases():
        (got,) = stats_of([sparse], backend)
        assert_oracle(got, reference_stats(dense), label)
        got = stats_of([torch.ones(2), sparse, dense], backend)
        assert_oracle(got[1], reference_stats(dense), f"{label} among plain tensors")
        assert_oracle(got[2], reference_stats(dense), f"{label}: the dense twin")


@isolated()
def test_detect_overflow_sees_inside_sparse_tensors():
    """``detect_overflow(sparse, ctx)`` prints ``ctx has infs`` / ``ctx has nans`` and returns
    True as the reference's does (COO; the reference cannot run on CSR, ours answers the same)."""
    inf = torch.tensor([[0.0, INF, 0.0], [2.0, 0.0, 0.0]])
    nan = torch.tensor([[0.0, NAN, 0.0], [2.0, 0.0, -INF]])
    finite = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    for dense in (inf, nan, finite):
        for sparse in (dense.to_sparse(), torch.sparse_coo_tensor(*_uncoalesced(dense))):
            want = captured(reference_detect_overflow, sparse, "ctx")
            assert captured(detect_overflow, sparse, "ctx") == want, (sparse, want)
        want = captured(reference_detect_overflow, dense, "ctx")  # what the dense tensor gets
        for sparse in (dense.to_sparse_csr(), dense.to_sparse_csc()):
            assert captured(detect_overflow, sparse, "ctx") == want, (sparse.layout, want)
    assert captured(detect_overflow, inf.to_sparse(), "ctx") == ("ctx has infs\n", True)
    assert captured(detect_overflow, nan.to_sparse_csr(), "ctx") == ("ctx has nans\nctx has infs\n", True)


def _uncoalesced(dense):
    """The entries of ``dense`` stored twice each: half the value, twice (same dense tensor
    unless a value is inf/nan, which stays inf/nan)."""
    coo = dense.to_sparse()
    indices, values = coo.indices(), coo.values()
    return torch.cat([indices, indices], 1), torch.cat([values / 2, values / 2]), dense.shape


@isolated()
def test_the_detector_reads_sparse_outputs():
    """A sparse tensor gets its numbers in a frame, and an inf in it is detected in both check
    modes (the reference fails on sparse tensors with its abs().min())."""
    dense = torch.tensor([[0.0, 2.0], [-INF, 0.0]])
    for sparse in (dense.to_sparse(), dense.to_sparse_csr()):
        def build():
            return nn.Sequential(Returns(sparse), nn.Identity())

        for check in CHECKS:
            out, outcomes = ours(build, [torch.ones(2)], check)
            assert outcomes == [OVERFLOW], (check, outcomes, out)
            assert "output has infs" in out.splitlines()
            assert "0.00e+00      inf output" in out.splitlines(), out


def _strided_nested_cases():
    return [
        ("1-d", [torch.tensor([1.0, NAN, -2.0]), torch.tensor([0.0])]),
        ("2-d", [torch.arange(6.0).reshape(2, 3) - 2, torch.tensor([[-INF, 1e-40, 3.0]])]),
        ("float16", [oracle.special_values(torch.float16)[:5], oracle.special_values(torch.float16)[5:]]),
        ("bfloat16", [torch.tensor([[1.0, -0.0]], dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16)]),
    ]


@isolated(params=BACKENDS, ids=["default", "torch"])
def test_strided_nested_tensor_numbers_are_those_of_all_its_elements(backend):
    """A nested tensor of the default (strided) layout: the statistics of all its elements,
    contiguous or not; never torch's internal errors."""
    for label, components in _strided_nested_cases():
        nt = torch.nested.nested_tensor(components)
        assert nt.is_nested and nt.layout == torch.strided
        want = reference_stats(torch.cat([c.reshape(-1) for c in components]))
        (got,) = stats_of([nt], backend)
        assert_oracle(got, want, f"strided nested {label}")
        got = stats_of([torch.ones(1), nt], backend)[1]
        assert_oracle(got, want, f"strided nested {label} among plain tensors")
        if components[0].dim() == 2:
            transposed = nt.transpose(1, 2)
            assert not transposed.is_contiguous()
            (got,) = stats_of([transposed], backend)
            assert_oracle(got, want, f"transposed strided nested {label}")


@isolated()
def test_strided_nested_tensor_in_the_detector():
    """A nan in a strided nested tensor is detected in both check modes (the reference crashes:
    abs().min() is not implemented for it)."""
    good = torch.nested.nested_tensor([torch.tensor([1.0, -2.0]), torch.tensor([4.0])])
    bad = torch.nested.nested_tensor([torch.tensor([1.0, -2.0]), torch.tensor([NAN])])
    for check in CHECKS:
        out, outcomes = ours(lambda: nn.Sequential(Returns(good), nn.Identity()), [torch.ones(2)] * 2, check,
                             trace_batch_nums=[0])
        assert outcomes == [None, None], (check, outcomes, out)
        assert "1.00e+00 4.00e+00 output" in out.splitlines(), out
        out, outcomes = ours(lambda: nn.Sequential(Returns(bad), nn.Identity()), [torch.ones(2)], check)
        assert outcomes == [OVERFLOW], (check, outcomes, out)
        assert "output has nans" in out.splitlines(), out
    assert captured(detect_overflow, bad, "n") == ("n has nans\n", True)


@isolated()
def test_unreadable_lines_stay_short():
    """Whatever the reason a tensor cannot be read (no data, an op that fails with a long
    message, an unsupported kind or dtype), its line is ``       unreadable <ctx> (<reason>)``,
    at most 120 characters, and neither ``tensor_stats`` nor the detector crashes."""
    broken = BrokenWrapper((2, 3))
    with pytest.raises(Exception):
        tensor_stats([broken])
    with pytest.raises(Exception):
        tensor_stats([torch.ones(2), broken], "torch")
    odd = [broken, BrokenWrapper((4,), torch.bfloat16), torch.ones(2, device="meta"), fake_tensor(torch.ones(2)),
           torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, torch.qint8)]
    for name in ("float4_e2m1fn_x2", "bits8"):
        if hasattr(torch, name):
            odd.append(torch.zeros(4, dtype=torch.uint8).view(getattr(torch, name)))
    for check in CHECKS:
        for kwargs in ({"trace_batch_nums": [0]}, {}):
            def build():
                return nn.Sequential(Returns(tuple(odd) + (torch.tensor([NAN]),)), nn.Identity())

            out, outcomes = ours(build, [torch.ones(2)], check, **kwargs)
            assert outcomes == ([None] if kwargs else [OVERFLOW]), (check, outcomes, out)
            lines = unreadable_lines(out)
            for ctx in ("output[0]", "output[1]", "output[2]", "output[3]", "output[4]"):
                assert_unreadable_line(out, ctx)
            for line in lines:
                assert len(line) <= 120, f"{len(line)} characters: {line!r}"
            assert f"output[{len(odd)}] has nans" in out.splitlines(), out
