"""check="batch" stages a forward's tensors and reads them when it ends: what a tensor changed in
place after its hook must still show (the numbers it had at hook time, as the reference prints),
how often the engine runs, and what staging keeps alive."""

import weakref

import pytest
import torch
from torch import nn

import overflow_fast.rows as rows_module
from overflow_fast import native
from compat import assert_identical, capture, forward, run
from overflow_fast import DebugUnderflowOverflow
from overflow_fast.rows import AT_ONCE, CHANGED_IN_PLACE, STAGE

INF, NAN = float("inf"), float("nan")


@pytest.fixture(autouse=True, params=["native", "python"])
def stage_cpu_tensors(monkeypatch, request):
    """Staging is the accelerators' path; its logic does not depend on the device, so these tests
    run it on CPU tensors; each twice: with the hook's loops in C++ (overflow_fast.native) and
    with their Python twins alone (the path without the extension)."""
    monkeypatch.setattr(rows_module, "STAGE_CPU_TENSORS", True)
    if request.param == "python":
        for name in ("frame_entries", "hook_frame", "stage_tensors", "stage_call", "all_unchanged", "read_rows",
                     "resolve_rows"):
            monkeypatch.setattr(native, name, None)
    elif native.frame_entries is None:
        pytest.skip("the C++ extension is unavailable")


def test_cpu_tensors_are_read_in_their_hooks_by_default(monkeypatch):
    monkeypatch.setattr(rows_module, "STAGE_CPU_TENSORS", False)
    model = seeded(Erased, False)
    detector = DebugUnderflowOverflow(model, check="batch")
    for batch in vectors(2):
        forward(model, batch)
    assert detector._deferred.modes == {}


class Block(nn.Module):
    """A ResNet basic block: ReLU(inplace=True) rewrites each BatchNorm's output after its hook,
    and the residual is added in place into the second one."""

    def __init__(self, channels=3):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 1)
        self.blocks = nn.Sequential(Block(), Block())
        self.drop = nn.Dropout(0.5, inplace=True)
        self.head = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        y = self.drop(self.blocks(self.stem(x)))
        return self.head(y.flatten(1))


class Erased(nn.Module):
    """The overflow is born in ``a`` and erased in place by the parent before any later hook:
    only a read in a's hook sees it."""

    def __init__(self, erase=True):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.a.weight.copy_(10 * torch.eye(4))  # a float32 value over 3.4e37 overflows here
        self.erase = erase

    def forward(self, x):
        y = self.a(x)
        if self.erase:
            torch.nan_to_num_(y, nan=0.0, posinf=1.0, neginf=-1.0)
        return self.b(y)


def images(count, bad_at=None, value=INF):
    torch.manual_seed(0)
    batches = [torch.randn(2, 2, 4, 4) for _ in range(count)]
    if bad_at is not None:
        batches[bad_at][1, 0, 2, 1] = value
    return batches


def vectors(count, bad_at=None, value=1e38):
    torch.manual_seed(0)
    batches = [torch.randn(2, 4) for _ in range(count)]
    if bad_at is not None:
        batches[bad_at][0, 1] = value  # inf after a's matmul
    return batches


def train_step(model, batch):
    model(batch).square().mean().backward()


def seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


@pytest.mark.parametrize("steps", [forward, train_step], ids=["no_grad", "train"])
@pytest.mark.parametrize("bad_at", [None, 0, 2])
def test_in_place_models_report_what_the_reference_reports(steps, bad_at):
    model = seeded(Net).train()  # batch norm in training mode: batch statistics, dropout in place
    assert_identical(model, images(4, bad_at), steps=steps, check="batch")


@pytest.mark.parametrize("bad_at", [0, 1, 3])
def test_an_overflow_erased_in_place_after_its_hook_is_still_caught(bad_at):
    out, _, _ = assert_identical(seeded(Erased), vectors(4, bad_at), check="batch")
    assert "a Linear" in out and "output has infs" in out


@pytest.fixture
def engine_calls(monkeypatch):
    """The number of tensors of each engine call the detector makes, as a list that grows."""
    calls = []
    real = rows_module.tensor_stats

    def counting(tensors, backend=None, *, out=None):
        calls.append(len(tensors))
        return real(tensors, backend, out=out)

    monkeypatch.setattr(rows_module, "tensor_stats", counting)
    return calls


def test_staged_tensors_are_read_once_per_forward_after_the_first(engine_calls):
    model = seeded(Erased, False)
    detector = DebugUnderflowOverflow(model, check="batch")
    per_forward = []
    for batch in vectors(3):
        engine_calls.clear()
        forward(model, batch)
        per_forward.append(list(engine_calls))
    # first sight: each hook reads in the hook and watches; then one engine call per forward
    assert per_forward[0] == [4, 3]  # a: weight, bias, input, output; b: the same but its input (a's output)
    assert per_forward[1] == per_forward[2] == [sum(per_forward[0])]
    assert all(mode == STAGE for modes in detector._deferred.modes.values() for mode in modes)


def test_in_place_sites_are_read_in_their_hooks_the_rest_staged():
    model = seeded(Net).train()
    detector = DebugUnderflowOverflow(model, check="batch")
    forward(model, images(1)[0])
    modes = {detector.module_names[m]: list(v) for m, v in detector._deferred.modes.items()}
    # bn outputs are rewritten by the in-place ReLU, the second by the residual add too; the
    # block's output by the in-place dropout; weights and a Linear's output are left alone
    assert modes["blocks.0.bn1"][-1] == AT_ONCE and modes["blocks.0.bn2"][-1] == AT_ONCE
    assert modes["blocks.1"][-1] == AT_ONCE
    assert modes["head"] == [STAGE, STAGE, STAGE, STAGE]
    assert modes["blocks.0.conv1"][0] == STAGE  # its weight


def test_a_change_in_place_never_seen_before_is_shown_not_its_later_numbers():
    model = seeded(Erased, False)
    detector = DebugUnderflowOverflow(model, check="batch", max_frames_to_save=10)
    batches = vectors(3, bad_at=2)
    forward(model, batches[0])  # learned: a's output is left alone
    model.erase = True  # a new pattern: the parent now rewrites a's output after its hook
    forward(model, batches[1])
    a_frames = [f for f in detector.frames if not isinstance(f, str) and f.module_name == "a"]
    text = str(a_frames[-1])
    assert text.splitlines()[-1].endswith(f"unreadable output ({CHANGED_IN_PLACE})")
    # from then on it is read in the hook: the overflow the parent erases is caught
    out, error = capture(lambda: forward(model, batches[2]))
    assert error is not None and "output has infs" in out and "a Linear" in out


def test_a_new_pattern_after_learning_matches_the_reference_from_then_on():
    # with a ring of one frame, the forward that shows the change leaves nothing in the report
    model = seeded(Erased, False)
    batches = vectors(4, bad_at=3)

    def steps(model, batch):
        model.erase = batch is not batches[0]
        forward(model, batch)

    assert_identical(model, batches, steps=steps, check="batch", max_frames_to_save=1)


def test_stage_bytes_bounds_what_waits_and_keeps_the_report(engine_calls):
    def chain():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])

    data = [torch.randn(4, 8) for _ in range(3)]
    data[2][0, 0] = INF
    want = run(DebugUnderflowOverflow, chain(), data, forward, check="module")[:2]
    got = run(DebugUnderflowOverflow, chain(), data, forward, check="batch", stage_bytes=300)[:2]
    small = DebugUnderflowOverflow(chain(), check="batch", stage_bytes=300)
    for _ in range(2):
        engine_calls.clear()
        forward(small.model, data[0])
    no_grad_calls = len(engine_calls)
    for _ in range(2):
        engine_calls.clear()
        small.model(data[0]).sum().backward()
    training_calls = len(engine_calls)
    assert got == want
    # under no_grad each Linear's output (4 x 8 float32: 128 bytes) is kept alive by staging
    # alone: read every third hook; the weights, which autograd keeps, do not count
    assert no_grad_calls == 3
    # in training autograd keeps the activations until backward: one read at the end
    assert training_calls == 1


def test_staging_keeps_nothing_alive_after_the_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    detector = DebugUnderflowOverflow(model, check="batch")
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o)))
    for _ in range(2):
        forward(model, torch.randn(2, 4))
    assert seen[-1]() is None  # the middle activation is freed once the forward is over
    state = next(iter(detector._deferred._devices.values()))
    assert state.staged == [] and detector._deferred._watched == []


def test_staging_is_off_without_version_counters_or_reuse():
    for kwargs in ({"reuse_stats": False}, {"stage_bytes": 0}):
        model = seeded(Erased)
        detector = DebugUnderflowOverflow(model, check="batch", **kwargs)
        forward(model, vectors(1)[0])
        forward(model, vectors(1)[0])
        if "reuse_stats" in kwargs:
            assert detector._deferred.modes == {}
    model = seeded(Erased)
    assert_identical(model, vectors(3, bad_at=2), steps=lambda m, b: _inference(m, b), check="batch")


def _inference(model, batch):
    with torch.inference_mode():
        model(batch)


def test_stage_bytes_is_validated():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="stage_bytes"):
            DebugUnderflowOverflow(nn.Linear(2, 2), check="batch", stage_bytes=bad)


class Released(nn.Module):
    """After ``a``'s hook the parent frees or swaps its output's memory, as FSDP's ``resize_(0)``
    and ZeRO-3's ``param.data = ...`` do to parameters; neither bumps the version counter."""

    def __init__(self, how):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.a(x)
        z = self.b(y.clone())
        if self.how == "swap":
            y.data = torch.full_like(y, NAN)
        elif self.how == "free":
            y.untyped_storage().resize_(0)
        return z


@pytest.mark.parametrize("how", ["swap", "free"])
def test_memory_freed_or_swapped_after_the_hook_is_never_read(how):
    # learned from the first forward: read in its hook, the report is the reference's
    assert_identical(seeded(Released, how), vectors(3), check="batch")
    # a pattern the learning never saw: the line says so, no nan from the swapped data, no crash
    model = seeded(Released, None)
    detector = DebugUnderflowOverflow(model, check="batch", max_frames_to_save=10)
    forward(model, vectors(1)[0])
    model.how = how
    out, error = capture(lambda: forward(model, vectors(1)[0]))
    assert error is None and "nan" not in out
    a_frame = [f for f in detector.frames if not isinstance(f, str) and f.module_name == "a"][-1]
    assert str(a_frame).splitlines()[-1].endswith(f"unreadable output ({CHANGED_IN_PLACE})")
    forward(model, vectors(1)[0])  # read in its hook from then on
    a_frame = [f for f in detector.frames if not isinstance(f, str) and f.module_name == "a"][-1]
    assert "unreadable" not in str(a_frame)


def test_python_constructors_of_a_hook_equal_the_ones_in_use():
    # without the extension frames.py makes its Frame and Call in Python
    from overflow_fast import frames

    call = frames._python_call("frame", False, True, False, 0, 1, 1)
    assert type(call) is frames.Call and call == frames.Call("frame", False, True, False, 0, 1, 1)
    assert call == frames.make_call("frame", False, True, False, 0, 1, 1)
    module = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    made, tensors = frames.hook_frame({module: "lin"}, module, (x,), module(x))
    want = frames.Frame("lin", "Linear", made.entries, made.dtypes)
    assert [getattr(made, slot) for slot in frames.Frame.__slots__] == [getattr(want, slot) for slot in frames.Frame.__slots__]
    assert len(tensors) == 4
