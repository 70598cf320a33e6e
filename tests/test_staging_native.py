"""The C++ twins of a hook's loops (csrc/staging.cpp, ``overflow_fast.native``) against their Python
specifications: ``frame_entries`` against frames.py's ``entries_of(forward_items(...))``,
``stage_tensors`` against rows.py's ``_stage``, ``all_unchanged`` against ``_all_unchanged``.
Same inputs, same Python objects out, same state left behind."""

import collections
import dataclasses
import sys
import types
import weakref

import pytest
import torch
from torch import nn

from overflow_fast import native
from overflow_fast.frames import entries_of, forward_frame, forward_items
from overflow_fast.rows import AT_ONCE, STAGE, UNKNOWN, _all_unchanged, _DeviceRows, _stage

pytestmark = pytest.mark.skipif(native.frame_entries is None, reason="the C++ extension is unavailable")


class Sub(torch.Tensor):
    pass


Pair = collections.namedtuple("Pair", "a b")


def odd_tensors():
    """Tensors off the hot path's fast test, each for its own reason."""
    values = torch.randn(4, 3)
    with torch.inference_mode():
        inference = torch.ones(3)
    return [
        values.as_subclass(Sub),  # a subclass: Python's unreadable_reason decides
        torch.empty(2, device="meta"),  # unreadable
        torch.zeros(3, dtype=torch.uint16),  # a dtype the engine does not read
        torch.randn(3, dtype=torch.complex64),  # readable, off the fast test
        values.to_sparse(),  # another layout
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        inference,
        values.t(),  # non-contiguous: still the fast path
        torch.tensor(2.5),  # 0-dim
        torch.empty(0),
    ]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.register_parameter("alias", self.weight)  # one tensor under two names
        self.register_parameter("missing", None)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float16))


class MetaWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, device="meta"))
        self.bias = nn.Parameter(torch.zeros(3))


def call_shapes():
    """(module, input, output, kwargs) of hook calls of every shape forward_items knows."""
    x, y = torch.randn(2, 3), torch.randn(3, dtype=torch.bfloat16)
    odd = odd_tensors()
    many = tuple(torch.randn(1) for _ in range(20))  # past the cached names
    linear, bare, tied, meta = nn.Linear(3, 2), nn.Linear(3, 2, bias=False), Tied(), MetaWeight()
    return [
        (linear, (x,), y, None),
        (bare, (x, None, 3, "s"), (y, (x, None, y), None, [x]), None),
        (tied, x, (x, x), {}),
        (meta, (), None, {"mask": x, "flag": True, "none": None, "odd": odd[0]}),
        (nn.ReLU(), many, many, None),
        (nn.Identity(), tuple(odd), tuple(odd), {"k": odd[3]}),
        (nn.Identity(), (Pair(x, y),), Pair(x, (y, x)), None),
        (nn.Identity(), ({"a": x},), {"a": x}, None),
        (nn.Identity(), ((),), ((), ((),)), None),
    ]


@dataclasses.dataclass
class Record:
    value: object


# which call_shapes() hold a value that containers=True opens (the C++ loop leaves those to Python)
OPENED = {1, 6, 7, 8}


@pytest.mark.parametrize("containers", [False, True])
@pytest.mark.parametrize("shape", range(len(call_shapes())))
def test_frame_entries_equal_the_python_entries(shape, containers):
    module, input, output, kwargs = call_shapes()[shape]
    expected = entries_of(forward_items(module, input, output, kwargs, containers))
    found = native.frame_entries(module._parameters, input, output, kwargs or None, containers)
    if containers and shape in OPENED:
        assert found is None
    else:
        entries, tensors, dtypes = found
        assert entries == expected[0]
        assert len(tensors) == len(expected[1])
        assert all(a is b for a, b in zip(tensors, expected[1]))
        assert dtypes == expected[2]
    # and forward_frame, which takes the C++ path where it can, builds the same frame
    frame, frame_tensors = forward_frame("m", module, input, output, kwargs, containers)
    assert frame.entries == expected[0] and frame.dtypes == expected[2]
    assert all(a is b for a, b in zip(frame_tensors, expected[1]))


@pytest.mark.parametrize("where", ["input", "kwargs", "output", "nested output"])
@pytest.mark.parametrize("container", ["list", "dict", "dataclass", "tuple"])
def test_frame_entries_leaves_every_container_to_python(where, container):
    x = torch.randn(2)
    value = {"list": [x], "dict": {"a": x}, "dataclass": Record(x), "tuple": (x, None)}[container]
    input, output, kwargs = (x,), x, None
    if where == "input":
        input = (x, value)
    elif where == "kwargs":
        kwargs = {"k": value}
    elif where == "output":
        output = value if container != "tuple" else (x, Record(x))
    else:
        output = (x, (x, value))
    assert native.frame_entries({}, input, output, kwargs, True) is None
    plain = native.frame_entries({}, input, output, kwargs, False)
    assert plain[0] == entries_of(forward_items(nn.Identity(), input, output, kwargs))[0]


def test_frame_entries_rejects_bad_arguments():
    with pytest.raises(TypeError, match="frame_entries"):
        native.frame_entries([], (), None, None, False)
    with pytest.raises(TypeError, match="frame_entries"):
        native.frame_entries({}, (), None, None)
    with pytest.raises(TypeError, match="frame_entries"):
        native.frame_entries({}, (), None, [], False)
    with pytest.raises(TypeError, match="frame_entries"):
        native.frame_entries({}, (), None, None, 1)


def test_frame_entries_passes_python_errors_on():
    class Broken(torch.Tensor):
        @property
        def dtype(self):
            raise RuntimeError("no dtype here")

    broken = torch.randn(2).as_subclass(Broken)
    with pytest.raises(RuntimeError):
        entries_of(forward_items(nn.Identity(), (broken,), None))
    with pytest.raises(RuntimeError):
        native.frame_entries({}, (broken,), None, None, False)


# -- stage_tensors ----------------------------------------------------------------------------------

def _state(launched=0):
    state = _DeviceRows(torch.empty((64, 8), dtype=torch.int64))
    state.used = state.launched = launched
    return state


def _snapshot(result, state, known, watched, names):
    """Everything the loop returned or left behind, with the objects of one run replaced by their
    names (``names``: id -> name; tensors, their ids and data pointers by the tensor's name), so
    that two runs on their own tensors compare."""

    def name(value):
        if isinstance(value, tuple):
            return tuple(name(v) for v in value)
        if isinstance(value, list):
            return names.get(id(value), [name(v) for v in value])
        if isinstance(value, int) and not isinstance(value, bool):
            return names.get(("int", value), value)
        return names.get(id(value), value)

    sources, used, launch_now, staged_bytes, watched_bytes = result
    return {
        "returned": (name(sources), used, launch_now, staged_bytes, watched_bytes),
        "staged": name(list(state.staged)),
        "versions": list(state.versions),
        "pointers": name(list(state.pointers)),
        "known": None if known is None else {name(key): (name(entry[0]()), entry[1], name(entry[2]))
                                            for key, entry in known.items()},
        "watched": name(watched),
    }


def _scenario(stage):
    """A sequence of hook calls through ``stage`` (the C++ or the Python loop): reuse within a
    forward, changes in place, every staging mode, inference and sparse tensors, rows already on
    the host, an owner whose slots were launched. Returns a snapshot after every call."""
    torch.manual_seed(0)
    a, b = torch.randn(4), torch.randn(3, requires_grad=True)
    c = torch.randn(2, 2).t()
    d = torch.randn(5)
    sparse = torch.randn(3, 3).to_sparse()
    with torch.inference_mode():
        inference = torch.ones(2)
    host_row = [1, 2, 0, 0, 0, 0, 0, 4]
    other, state = _state(launched=5), _state()
    other.used = 7  # slots 5, 6 wait
    modes = [UNKNOWN, STAGE, AT_ONCE, UNKNOWN, STAGE]
    more_modes = [STAGE] * 5
    names = {id(state): "state", id(other): "other", id(modes): "modes", id(more_modes): "more_modes",
             id(host_row): "host_row"}
    for label, tensor in dict(a=a, b=b, c=c, d=d, sparse=sparse, inference=inference).items():
        names[id(tensor)] = label
        names[("int", id(tensor))] = f"id({label})"
        if tensor.layout == torch.strided:
            names[("int", tensor.data_ptr())] = f"pointer({label})"
    known = {id(c): (weakref.ref(c), c._version, host_row), id(b): (weakref.ref(b), b._version, (other, 6)),
             id(sparse): (weakref.ref(sparse), 0, (other, 5)), id(d): (weakref.ref(d), 0, (other, 2))}
    watched = []
    snapshots = []
    calls = [
        ([a, b, c], known, modes),
        ([a, a, inference, sparse], known, modes),  # a again: reused within the call and after it
        ([b, c], known, more_modes),
        ([d, b], known, modes),  # d's row was launched already: watched, but no launch for it
        ([a, b], None, None),  # no reuse, read at once
        ([inference, c, a], known, None),
    ]
    for step, (tensors, table, call_modes) in enumerate(calls):
        if step == 4:
            a.add_(1)  # a changed in place: a new version, a new slot
        result = stage(tensors, table, state, call_modes, watched)
        snapshots.append(_snapshot(result, state, table, watched, names))
    return snapshots


def test_stage_tensors_equals_the_python_loop():
    python = _scenario(_stage)
    native_ = _scenario(native.stage_tensors)
    assert len(python) == len(native_)
    for step, (expected, got) in enumerate(zip(python, native_)):
        for key in expected:
            assert got[key] == expected[key], (step, key)


def test_stage_tensors_leaves_subclasses_to_python():
    state = _state()
    tensors = [torch.randn(2), torch.randn(2).as_subclass(Sub)]
    assert native.stage_tensors(tensors, {}, state, None, []) is None
    assert state.staged == [] and state.used == 0  # nothing was touched


def test_stage_tensors_leaves_other_devices_to_python():
    state = _state()
    tensors = [torch.randn(2), torch.empty(2, device="meta")]
    assert native.stage_tensors(tensors, {}, state, None, []) is False
    assert state.staged == [] and state.used == 0


def test_stage_tensors_rejects_bad_arguments():
    with pytest.raises(TypeError, match="stage_tensors"):
        native.stage_tensors((torch.ones(1),), None, _state(), None, [])
    with pytest.raises(ValueError, match="shorter"):
        native.stage_tensors([torch.ones(1)] * 3, None, _state(), [UNKNOWN], [])
    with pytest.raises(AttributeError, match="has no attribute"):
        native.stage_tensors([torch.ones(1)], None, object(), None, [])


# -- all_unchanged ----------------------------------------------------------------------------------

def test_all_unchanged_agrees_with_python():
    tensors = [torch.randn(3), torch.randn(2, 2).t(), torch.empty(0), nn.Parameter(torch.ones(2))]
    versions = [t._version for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    assert native.all_unchanged(tensors, versions, pointers) is True
    assert _all_unchanged(tensors, versions, pointers) is True
    tensors[1].mul_(2)  # a new version
    assert native.all_unchanged(tensors, versions, pointers) is False
    assert _all_unchanged(tensors, versions, pointers) is False
    versions[1] = tensors[1]._version
    with torch.no_grad():
        tensors[3].data = torch.zeros(2)  # new memory, the version counter untouched
    assert native.all_unchanged(tensors, versions, pointers) is False
    assert _all_unchanged(tensors, versions, pointers) is False
    pointers[3] = tensors[3].data_ptr()
    assert native.all_unchanged(tensors, versions, pointers) is True


@pytest.mark.parametrize("odd", ["inference", "sparse", "subclass", "lengths"])
def test_all_unchanged_says_look_at_each_for_what_it_cannot_tell(odd):
    """False (look at each tensor) where a tensor has no version counter or data pointer, is of
    another type, or the lists disagree."""
    if odd == "inference":
        with torch.inference_mode():
            tensor = torch.ones(2)
        versions, pointers = [-1], [tensor.data_ptr()]
    elif odd == "sparse":
        tensor = torch.randn(2, 2).to_sparse()
        versions, pointers = [tensor._version], [None]
    elif odd == "subclass":
        tensor = torch.randn(2).as_subclass(Sub)
        versions, pointers = [tensor._version], [None]
    else:
        tensor = torch.randn(2)
        versions, pointers = [0, 0], [tensor.data_ptr()]
    assert native.all_unchanged([tensor], versions, pointers) is False


def test_entries_stay_right_past_the_entry_cache():
    """Entry tuples of long-lived names are made once and shared; more names than the cache holds
    (modules made and dropped at run time) clear it, and every frame still gets its own entries."""
    x = torch.randn(2)
    for step in range(20000):
        name = f"weight_{step}"
        parameters = {name: nn.Parameter(torch.ones(1)), "none": None}
        entries, tensors, dtypes = native.frame_entries(parameters, (x,), x, None, False)
        assert entries == [(0, name, 0), (0, "input[0]", 1), (0, "output", 2)]


def test_a_frame_marked_unreadable_leaves_the_next_frames_entries_alone():
    module, x = nn.Linear(2, 2), torch.randn(1, 2)
    first, _ = forward_frame("m", module, (x,), x)
    first.mark_unreadable(0, "gone")
    second, _ = forward_frame("m", module, (x,), x)
    assert first.entries[0] == (3, "weight", "gone")
    assert second.entries[0] == (0, "weight", 0)


# -- make_frame, make_call: a hook's Frame and Call made in C ----------------------------------

from overflow_fast.frames import FORWARD, Call, Frame  # noqa: E402


def test_make_frame_equals_the_python_frame_in_every_slot():
    entries, dtypes = [(0, "weight", 0)], [torch.float16]
    made = native.make_frame("layer.0", "Linear", entries, dtypes)
    want = Frame("layer.0", "Linear", entries, dtypes)
    assert type(made) is Frame
    for slot in Frame.__slots__:
        assert getattr(made, slot) == getattr(want, slot), slot
    assert made.entries is entries and made.dtypes is dtypes and made.phase is FORWARD
    # a frame like any other: mutable, its methods work, collected when dropped
    made.rows = [[0] * 8]
    made.mark_unreadable(0, "gone")
    assert made.entries == [(3, "weight", "gone")] and made.lead == ()
    made.mark_bad_shards(0, [1])
    assert made.bad_shards == {0: [1]}

    class Token:
        pass

    token = Token()
    alive = weakref.ref(token)
    held = native.make_frame(token, "Linear", [], [])
    del token
    assert alive() is held.module_name
    del held
    assert alive() is None  # the frame released what it held


def test_make_call_equals_the_namedtuple():
    frame = native.make_frame("m", "Linear", [], [])
    fields = (frame, False, True, False, 3, 4, 17)
    made = native.make_call(*fields)
    assert type(made) is Call and made == Call(*fields) and made._asdict() == Call(*fields)._asdict()
    assert made.frame is frame and made.batch_after == 4 and made.total_calls == 17 and len(made) == 7
    assert made._replace(trace_mode=True).trace_mode is True


def test_make_frame_and_make_call_reject_bad_arguments():
    with pytest.raises(TypeError, match="make_frame"):
        native.make_frame("m", "Linear", [])
    with pytest.raises(TypeError, match="make_call"):
        native.make_call(None, False)
    rest = ({}, str, nn.Module.named_parameters)
    with pytest.raises(TypeError, match="namedtuple of 7 fields"):
        native.frame_setup(Frame, tuple, FORWARD, *rest)
    with pytest.raises(TypeError, match="plain __slots__ class"):
        native.frame_setup(int, Call, FORWARD, *rest)
    with pytest.raises(TypeError, match="not a __slots__ slot"):
        native.frame_setup(type("NoSlots", (), {}), Call, FORWARD, *rest)
    # the failed setups changed nothing
    assert type(native.make_frame("m", "Linear", [], [])) is Frame


def test_forward_frame_makes_frames_in_c_equal_to_python_ones():
    module = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    frame, tensors = forward_frame("lin", module, (x,), module(x))
    entries, want_tensors, dtypes = entries_of(forward_items(module, (x,), module(x)))
    want = Frame("lin", "Linear", entries, dtypes)
    assert type(frame) is Frame and len(tensors) == len(want_tensors) == 4
    for slot in ("lead", "module_name", "class_name", "entries", "dtypes", "rows", "phase", "consumers", "bad_shards"):
        assert getattr(frame, slot) == getattr(want, slot), slot


def test_hook_frame_equals_the_python_frame_on_every_call_shape():
    from overflow_fast.frames import hook_frame

    class Named(nn.Linear):
        def named_parameters(self, *args, **kwargs):  # overridden: Python lists them
            return super().named_parameters(*args, **kwargs)

    x = torch.randn(4, 3)
    named, unnamed, overriding = nn.Linear(3, 2), nn.Linear(3, 2), Named(3, 2)
    names = {named: "encoder.proj", overriding: "head"}
    calls = [(named, (x,), named(x), None, False), (unnamed, (x, None, 3), (x, (x, x)), {"mask": x, "n": 1}, False),
             (named, x, [x], None, True), (overriding, (x,), x, None, False), (named, (), None, {}, True)]
    for module, input, output, kwargs, containers in calls:
        want_frame, want_tensors = forward_frame(names.get(module, "?"), module, input, output, kwargs, containers)
        got = native.hook_frame(names, module, input, output, kwargs or None, containers)
        if containers and isinstance(output, list) or module is overriding:
            assert got is None  # left to Python
        else:
            frame, tensors = got
            assert [id(t) for t in tensors] == [id(t) for t in want_tensors]
            for slot in Frame.__slots__:
                assert getattr(frame, slot) == getattr(want_frame, slot), (slot, module)
        frame, tensors = hook_frame(names, module, input, output, kwargs, containers)
        assert (frame.module_name, frame.entries, frame.dtypes) == (want_frame.module_name, want_frame.entries,
                                                                   want_frame.dtypes)
    with pytest.raises(TypeError, match="hook_frame"):
        native.hook_frame([], named, (x,), x, None, False)


# -- stage_call: must_read_before + add of a forward hook's call, in one C call ----------------

from overflow_fast import rows as rows_module  # noqa: E402
from overflow_fast.frames import make_call  # noqa: E402
from overflow_fast.reuse import ReuseCache  # noqa: E402


def _deferred(capacity=64, stage_bytes=1 << 30):
    return rows_module.DeferredRows(rows_module.RowReader(None, ReuseCache()), capacity, stage_bytes)


def _queued_state(deferred):
    """What the queue holds, with buffers named by device and tensors by id."""
    def source(value):
        return ("slot", value[1]) if type(value) is tuple else value

    return {
        "rows": [[source(s) for s in call.frame.rows] for call in deferred.pending],
        "pending_modes": [None if m is None else list(m) for m in deferred._pending_modes],
        "devices": {str(d): (s.used, s.launched, [id(t) for t in s.staged], list(s.versions), list(s.pointers),
                             s.staged_bytes) for d, s in deferred._devices.items()},
        "watched": [(id(t), v, p, list(m), i) for t, v, p, m, i in deferred._watched],
        "watched_bytes": deferred._watched_bytes,
        "modes": {id(k): list(v) for k, v in deferred.modes.items()},
        "known": {k: (v[1], source(v[2])) for k, v in deferred.reader.reuse._rows.items()},
    }


def _hook_sequence():
    torch.manual_seed(1)
    modules = [nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)]
    x = torch.randn(2, 3)
    h = modules[0](x)
    r = modules[1](h)
    with torch.no_grad():
        y = modules[2](r)  # an output that does not require grad: its bytes count
    return [(modules[0], [modules[0].weight, modules[0].bias, x, h]), (modules[1], [h, r]),
            (modules[2], [modules[2].weight, modules[2].bias, r, y])]


def _deepspeed_loaded(monkeypatch, loaded):
    if loaded:
        monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    else:
        monkeypatch.delitem(sys.modules, "deepspeed", raising=False)


@pytest.mark.parametrize("deepspeed", [False, True])
@pytest.mark.parametrize("stage_bytes", [1 << 30, 40])
def test_stage_call_equals_must_read_before_and_add(monkeypatch, stage_bytes, deepspeed):
    monkeypatch.setattr(rows_module, "STAGE_CPU_TENSORS", True)
    _deepspeed_loaded(monkeypatch, deepspeed)  # a loaded DeepSpeed changes nothing without empty tensors
    sequence = _hook_sequence()
    fast, slow = _deferred(stage_bytes=stage_bytes), _deferred(stage_bytes=stage_bytes)
    taken = []
    for forward in range(3):
        for deferred in (fast, slow):
            deferred.reader.reuse.open()
        for module, tensors in sequence:
            for deferred in (fast, slow):
                call = make_call(native.make_frame("m", "Linear", [], []), False, False, False, 0, 0, 0)
                if deferred is fast and deferred.stage(call, tensors, module):
                    taken.append(forward)
                    continue
                assert not deferred.must_read_before(tensors)
                deferred.add(call, tensors, module)
            assert _queued_state(fast) == _queued_state(slow), (forward, module)
        for deferred in (fast, slow):
            deferred.read()
            deferred.reader.reuse.close()
    # the first forward learns each module's modes in Python; the later ones take the C call
    assert 0 not in taken and taken.count(2) == len(sequence)


def test_stage_call_leaves_every_other_case_unchanged(monkeypatch):
    monkeypatch.setattr(rows_module, "STAGE_CPU_TENSORS", True)
    _deepspeed_loaded(monkeypatch, False)
    (module, tensors), *_ = _hook_sequence()

    def ready(capacity=64):
        deferred = _deferred(capacity)
        deferred.reader.reuse.open()
        deferred.add(make_call(native.make_frame("m", "Linear", [], []), False, False, False, 0, 0, 0), tensors,
                     module)
        deferred.modes[module] = [STAGE] * len(tensors)
        return deferred

    def untouched(deferred, tensors, module=module):
        before = _queued_state(deferred)
        call = make_call(native.make_frame("m", "Linear", [], []), False, False, False, 0, 0, 0)
        assert deferred.stage(call, tensors, module) is False
        assert _queued_state(deferred) == before and call.frame.rows is None

    untouched(ready(), [])  # no tensors
    untouched(ready(), tensors, nn.Linear(1, 1))  # a module not seen yet
    untouched(ready(), tensors + [torch.randn(2).as_subclass(Sub)])  # a subclass
    untouched(ready(), [torch.empty(2, device="meta")])  # another device
    untouched(ready(capacity=5), tensors)  # the buffer would overflow: read first
    full = ready()
    full.capacity = len(full.pending)
    untouched(full, tensors)  # the queue is full
    empty = torch.empty(0, 3)
    _deepspeed_loaded(monkeypatch, True)
    untouched(ready(), tensors + [empty])  # an empty tensor may be a released ZeRO-3 parameter
    _deepspeed_loaded(monkeypatch, False)
    taken = ready()
    taken.modes[module] = [STAGE] * (len(tensors) + 1)
    call = make_call(native.make_frame("m", "Linear", [], []), False, False, False, 0, 0, 0)
    assert taken.stage(call, tensors[:2] + [empty] + tensors[2:], module) is True  # without DeepSpeed: staged
    closed = ready()
    closed.reader.reuse.close()
    call = make_call(native.make_frame("m", "Linear", [], []), False, False, False, 0, 0, 0)
    assert closed.stage(call, tensors, module) is True  # outside a forward: staged, no reuse
    with pytest.raises(TypeError, match="stage_call"):
        native.stage_call(closed, closed.reader.reuse, [], tensors, module)


# -- read_rows, resolve_rows: the end-of-forward read ------------------------------------------

def _python_to_host(monkeypatch, rows):
    with monkeypatch.context() as patch:
        patch.setattr(native, "read_rows", None)
        return rows_module.to_host(rows)


@pytest.mark.parametrize("column", [None, 2, 3, 4])
def test_read_rows_equals_the_python_read(monkeypatch, column):
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(-(2**62), 2**62, (37, 8), generator=generator)
    rows[:, 2:5] = 0
    if column is not None:
        rows[29, column] = 1  # one nan, +inf or -inf count, late in the buffer
    for view in (rows, rows[:30], rows[::2]):  # the used part of a buffer, and a strided one
        values, nonfinite = rows_module.to_host(view)
        want_values, want_nonfinite = _python_to_host(monkeypatch, view)
        assert values.format == "q" and values.tolist() == want_values.tolist() == view.reshape(-1).tolist()
        assert nonfinite == want_nonfinite == bool(view[:, 2:5].any())


def test_read_rows_of_no_rows_and_bad_arguments():
    values, nonfinite = rows_module.to_host(torch.empty((0, 8), dtype=torch.int64))
    assert values.tolist() == [] and nonfinite is False
    with pytest.raises(TypeError, match="read_rows"):
        native.read_rows(torch.zeros(3, 8))  # not int64
    with pytest.raises(TypeError, match="read_rows"):
        native.read_rows(torch.zeros(3, 7, dtype=torch.int64))


def test_resolve_rows_equals_the_python_resolve(monkeypatch):
    values, _ = rows_module.to_host(torch.arange(5 * 8, dtype=torch.int64).reshape(5, 8) - 17)
    state = object()
    host_row = [9] * 8
    sources = [(state, 4), host_row, (state, 0), (state, 4)]
    frame, python_frame = Frame("m", "Linear", [], []), Frame("m", "Linear", [], [])
    frame.rows, python_frame.rows = list(sources), list(sources)
    rows_module.resolve(frame, values)
    with monkeypatch.context() as patch:
        patch.setattr(native, "resolve_rows", None)
        rows_module.resolve(python_frame, values)
    assert frame.rows == python_frame.rows == [list(range(15, 23)), host_row, list(range(-17, -9)),
                                               list(range(15, 23))]
    assert frame.rows[1] is host_row and frame.rows[0] is not frame.rows[3]  # lists of their own
    with pytest.raises(ValueError, match="names no row"):
        native.resolve_rows([(state, 5)], values)
    with pytest.raises(TypeError, match="int64"):
        native.resolve_rows([(state, 0)], memoryview(bytes(64)))  # bytes, not int64
    with pytest.raises(TypeError, match="resolve_rows"):
        native.resolve_rows((), values)


def test_a_hooks_objects_are_left_to_reference_counting():
    """Frames, calls, entry lists, row sources and reuse entries made by the C++ path can close
    no reference cycle: untracked, the collector's gen-0 passes skip them, and they are freed
    as soon as the last reference goes."""
    import gc

    module, x = nn.Linear(3, 2), torch.randn(2, 3)
    frame, tensors = native.hook_frame({module: "lin"}, module, (x,), module(x), None, False)
    call = native.make_call(frame, False, True, False, 0, 0, 1)
    assert not any(gc.is_tracked(o) for o in (frame, call, frame.entries, frame.dtypes, tensors))
    assert gc.is_tracked(Frame("lin", "Linear", [], []))  # Python's own frames stay tracked
    known, state = {}, _state()
    sources, *_ = native.stage_tensors(tensors, known, state, [STAGE] * len(tensors), [])
    assert not gc.is_tracked(sources)
    assert known and not any(gc.is_tracked(entry) or gc.is_tracked(entry[0]) for entry in known.values())
    alive = weakref.ref(tensors[-1])
    gc.disable()
    try:
        del frame, call, tensors, sources
        known.clear()
        state.drop_staged()
        assert alive() is None  # freed by reference counting alone, no collection needed
    finally:
        gc.enable()
