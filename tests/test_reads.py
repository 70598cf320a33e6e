"""When a hook's tensors are read: in the hook, before anything can change them, so that check="batch"
and watch() see what the reference sees, on the CPU path and on the accelerators' path
(OVERFLOW_FAST_CPU_AS_DEVICE, here by its module flag, which a detector asks as it is made); a pass
ends when the outermost hooked call returns, whatever module it is; ``defer=True`` and its documented hole; the reuse of rows and its
hole; and no hostile input can abort the process."""

import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

import overflow_fast.hooks.reads as reads_module
from compat import assert_identical, capture, forward, run
from overflow_fast import DebugUnderflowOverflow, watch
from overflow_fast.hooks.reads import CHANGED_AFTER_HOOK
from overflow_fast.stats import cpu_backend, kinds
from test_compat_rules import Scaled, batches, make, with_value

INF, NAN = float("inf"), float("nan")
CHECKS = ("module", "batch")


@pytest.fixture(params=["cpu", "device"])
def path(request, monkeypatch):
    """Each test twice: CPU tensors as CPU tensors, and as an accelerator's (deferral allowed)."""
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", request.param == "device")
    return request.param


def train(model, batch):
    model(batch).float().square().mean().backward()


def seeded(cls, *args, **kwargs):
    torch.manual_seed(0)
    return cls(*args, **kwargs)


# -- a tensor changed in place after its hook -----------------------------------------------------

class FixesUpOnTheBadStep(nn.Module):
    """The parent clamps its child's output in place, but only on a step where it overflowed: only
    a read in the child's hook sees the inf (a call site that is clean on every other step)."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.child.weight.copy_(10 * torch.eye(4))

    def forward(self, x):
        h = self.child(x)
        if torch.isinf(h).any():
            h.clamp_(-1e4, 1e4)
        return self.head(torch.relu(h))


def big(count, bad_at, value=1e38):
    torch.manual_seed(1)
    data = [torch.randn(3, 4) for _ in range(count)]
    if bad_at is not None:
        data[bad_at][1, 2] = value  # inf after the child's matmul (x 10 overflows float32)
    return data


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("steps", [forward, train], ids=["no_grad", "train"])
@pytest.mark.parametrize("bad_at", [0, 3])
def test_a_fix_up_in_place_only_on_the_bad_step_is_caught(path, check, steps, bad_at):
    out, outcomes, _ = assert_identical(seeded(FixesUpOnTheBadStep), big(5, bad_at), steps=steps, check=check)
    assert "child Linear" in out and "output has infs" in out and outcomes[bad_at] is not None


class Block(nn.Module):
    def forward(self, x, keep=None):
        return x * 1e30 if keep is None else x * 1e30 * keep


class Sanitises(nn.Module):
    """The parent always cleans its block's output in place (nan_to_num_), and passes an optional
    mask positionally on most steps but not on the bad one: the block's call positions shift."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        if x.abs().max() < 100:
            h = self.block(x, (x > -3).float())
        else:
            h = self.block(x)  # on the bad step, without the mask: output position 1, not 2
        torch.nan_to_num_(h, nan=0.0, posinf=1.0, neginf=-1.0)
        return self.head(h)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("steps", [forward, train], ids=["no_grad", "train"])
def test_a_sanitised_output_whose_call_positions_shift_on_the_bad_step_is_caught(path, check, steps):
    data = big(5, 3, value=1e9)  # 1e9 * 1e30 overflows float32 in the block
    out, outcomes, _ = assert_identical(seeded(Sanitises), data, steps=steps, check=check)
    assert "block Block" in out and "output has infs" in out and outcomes[3] is not None


class Residual(nn.Module):
    """ResNet-style: in-place ReLU on a norm's output, a residual added in place, in-place dropout."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5, inplace=True)

    def forward(self, x):
        out = self.relu(self.norm(self.lin(x)))
        out += x
        return self.drop(out)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("bad_at", [None, 0, 2])
def test_in_place_models_report_what_the_reference_reports(path, check, bad_at):
    model = seeded(nn.Sequential, Residual(), Residual()).train()
    assert_identical(model, big(4, bad_at, value=INF), steps=train, check=check)


# -- a pass ends when the outermost hooked call returns --------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_model_forward_called_directly_decides_at_the_bad_step(path, check):
    # the model's own hooks never run: each child it calls is a pass of its own
    data = with_value(batches(4), 2, INF)
    out, outcomes, _ = assert_identical(make(Scaled, depth=3), data, steps=lambda m, b: m.forward(b), check=check)
    assert outcomes[:2] == [None, None] and outcomes[2] is not None and "batch_number=0" in out


class Trainer(nn.Module):
    """A LightningModule's shape: the detector is attached to it, but the loop calls the inner
    network (``training_step``), never this module's forward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def training_step(self, batch):
        return self.net(batch).sum()


@pytest.mark.parametrize("options", [{"check": "batch"}, {}], ids=["batch", "watch"])
def test_an_inner_network_driven_by_a_trainer_decides_at_the_bad_step(path, options):
    model = seeded(Trainer)
    detector = watch(model, **options) if not options else DebugUnderflowOverflow(model, **options)
    data = with_value(batches(5), 3, NAN, at=(1, 1))
    errors = []
    for step, batch in enumerate(data):
        out, error = capture(lambda: model.training_step(batch).backward())
        if error is not None:
            errors.append(step)
            assert "net.0 Linear" in out and "input[0] has nans" in out
            break
    assert errors == [3]
    assert detector.batch_number == 0  # the reference's meaning: forwards of the model itself
    detector.remove()


class TwoSteps(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        return self.second(self.first(x))


def test_a_pre_hook_of_another_library_that_raises_before_ours(path):
    # the second module's call fails before its forward (and before the detector's pre hook):
    # its post hook still runs (always_call) and must not end the outer call's pass early
    model = seeded(TwoSteps)
    model.second.register_forward_pre_hook(lambda module, args: 1 / 0)
    DebugUnderflowOverflow(model, check="batch")
    x = torch.ones(2, 4)
    x[0, 0] = NAN
    out, error = capture(lambda: model(x), Exception)
    assert isinstance(error, ZeroDivisionError)
    assert "first Linear" in out and "input[0] has nans" in out  # decided when the outer call ended
    assert "inf/nan was detected earlier" in " ".join(getattr(error, "__notes__", []))
    # the next pass is a pass of its own; the flag sticks, as the reference's does: it raises
    out, error = capture(lambda: model.first(torch.ones(2, 4)))
    assert isinstance(error, ValueError) and "first Linear" in out


# -- deferral (opt in): one engine call per forward, and its hole ------------------------------------

@pytest.fixture
def engine_calls(monkeypatch):
    """The number of tensors of each engine call the detector makes, as a list that grows. No
    launcher is bound to the core, so that every read it hands out goes through ``tensor_stats``
    (with one bound, the core reads them itself: test_a_bound_launcher_reads_what_the_core_hands_out)."""
    calls = []
    real = reads_module.tensor_stats
    monkeypatch.setattr(reads_module, "rows_launcher", lambda backend, device: None)

    def counting(tensors, backend=None, *, out=None):
        calls.append(len(tensors))
        return real(tensors, backend, out=out)

    monkeypatch.setattr(reads_module, "tensor_stats", counting)
    return calls


def test_the_sound_default_reads_every_hook_with_new_tensors(path, engine_calls):
    model = seeded(nn.Sequential, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    DebugUnderflowOverflow(model, check="batch")
    for batch in batches(3):
        engine_calls.clear()
        forward(model, batch)
        # Linear: weight, bias, input, output; Tanh: its output (its input is the Linear's);
        # Linear: all but its input; the model's own call: nothing new
        assert engine_calls == [4, 1, 3]


@pytest.mark.skipif(cpu_backend.extension() is None, reason="the C++ extension is unavailable")
def test_a_bound_launcher_reads_what_the_core_hands_out(path):
    """From the device's first read on, its launcher is bound to the C++ core: each hook with new
    tensors is one launch made inside the core's call, and none goes through Python's engine call."""
    launcher = cpu_backend.launcher()
    model = seeded(nn.Sequential, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    DebugUnderflowOverflow(model, check="batch")
    per_forward = []
    for batch in batches(3):
        before = launcher.direct_launches
        forward(model, batch)
        per_forward.append(launcher.direct_launches - before)
    assert per_forward == [2, 3, 3]  # the first hook's read binds it


@pytest.mark.skipif(cpu_backend.extension() is None, reason="the C++ extension is unavailable")
def test_a_launcher_that_fails_is_said_once_and_the_detector_reads_on(path, monkeypatch):
    """A bound launcher whose launch raises: one warning with its reason, that call's tensors and
    every later one's read by the detector itself, and the report the same as the reference's."""
    import warnings

    from overflow_fast.stats import triton_backend as tb
    from overflow_fast.stats import triton_common, triton_launch

    def failing(*args):
        raise RuntimeError("compiler exploded")

    pool = torch.tensor(triton_launch._IDENTITY_ROW).repeat(tb.STREAM_GROUPS * tb.MAX_SLOTS, 1)
    broken = cpu_backend.extension().Launcher(
        "ordinary", torch.device("cpu"), triton_common._PLAIN_TYPES, triton_common._FORMAT_WORD,
        triton_common._ALIGNED_BIT, tb.BLOCK_SIZE * tb.BLOCKS_PER_CHUNK, tb.MAX_READ_LAUNCHES,
        triton_common.MAX_FORMATS, pool, tb.STREAM_GROUPS, None, None, True, failing)
    monkeypatch.setattr(reads_module, "rows_launcher", lambda backend, device: broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, outcomes, _ = assert_identical(seeded(FixesUpOnTheBadStep), big(5, 3), steps=train, check="batch")
    said = [str(w.message) for w in caught if "per-hook read" in str(w.message)]
    assert len(said) == 1 and "compiler exploded" in said[0], said
    assert broken.disabled == "RuntimeError: compiler exploded"
    assert outcomes[3] is not None and "inf" in out


def test_defer_reads_a_forward_in_one_engine_call_after_the_first(engine_calls, monkeypatch):
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", True)
    model = seeded(nn.Sequential, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    DebugUnderflowOverflow(model, check="batch", defer=True)
    per_forward = []
    for batch in batches(3):
        engine_calls.clear()
        forward(model, batch)
        per_forward.append(list(engine_calls))
    # first sight: every hook reads in the hook (and watches); then one engine call per forward
    assert per_forward[0] == [4, 1, 3]
    assert per_forward[1] == per_forward[2] == [8]


def test_defer_is_only_for_accelerators(engine_calls, monkeypatch):
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", False)
    model = seeded(nn.Sequential, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    DebugUnderflowOverflow(model, check="batch", defer=True)
    for batch in batches(3):
        engine_calls.clear()
        forward(model, batch)
    assert engine_calls == [4, 1, 3]  # CPU tensors on the CPU path: read in their hooks


@pytest.mark.parametrize("steps", [forward, train], ids=["no_grad", "train"])
def test_defer_reads_sites_changed_in_place_in_their_hooks(steps, monkeypatch):
    # learned on the first forward: the in-place ReLU, the residual add and dropout rewrite
    # outputs after their hooks; those are read in their hooks, the report is the reference's
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", True)
    model = seeded(nn.Sequential, Residual(), Residual()).train()
    assert_identical(model, big(4, 2, value=INF), steps=steps, check="batch", ours={"defer": True})


def test_defer_hole_a_fix_up_only_on_the_bad_step_is_missed(monkeypatch):
    # the documented hole: the call site was clean when learned, then changed in place on the bad
    # step; its values at the hook are lost: the line says so and the inf is not detected
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", True)
    model = seeded(FixesUpOnTheBadStep)
    detector = DebugUnderflowOverflow(model, check="batch", defer=True, max_frames_to_save=10)
    data = big(4, 2)
    for batch in data[:2]:
        forward(model, batch)
    out, error = capture(lambda: forward(model, data[2]))
    assert error is None and "has infs" not in out
    child = [frame for frame in detector.frames if frame.module_name == "child"][-1]
    assert str(child).splitlines()[-1].endswith(f"unreadable output ({CHANGED_AFTER_HOOK})")
    # from then on that site is read in its hook: the next overflow is caught
    out, error = capture(lambda: forward(model, data[2]))
    assert isinstance(error, ValueError) and "child Linear" in out and "output has infs" in out


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
def test_memory_freed_or_swapped_after_the_hook_is_never_read(path, how):
    assert_identical(seeded(Released, how), batches(3), check="batch")
    # under deferral, a pattern never seen before: the line says so, no nan, no crash
    model = seeded(Released, None)
    detector = DebugUnderflowOverflow(model, check="batch", defer=True, max_frames_to_save=10)
    forward(model, batches(1)[0])
    model.how = how
    out, error = capture(lambda: forward(model, batches(1)[0]))
    assert error is None and "nan" not in out
    changed = [frame for frame in detector.frames if frame.module_name == "a" and "unreadable" in str(frame)]
    assert bool(changed) == (path == "device")


def test_defer_bounds_what_only_it_keeps_alive(engine_calls, monkeypatch):
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", True)

    def chain():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])

    data = [torch.randn(4, 8) for _ in range(3)]
    data[2][0, 0] = INF
    want = run(DebugUnderflowOverflow, chain(), data, forward, check="module")[:2]
    got = run(DebugUnderflowOverflow, chain(), data, forward, check="batch", defer=True, stage_bytes=300)[:2]
    assert got == want
    small = DebugUnderflowOverflow(chain(), check="batch", defer=True, stage_bytes=300)
    for _ in range(2):
        engine_calls.clear()
        forward(small.model, data[0])
    no_grad_calls = len(engine_calls)
    for _ in range(2):
        engine_calls.clear()
        small.model(data[0]).sum().backward()
    # under no_grad each Linear's output (4 x 8 float32: 128 bytes) is kept alive by deferral
    # alone: read every third hook; the weights, which autograd keeps, do not count
    assert no_grad_calls == 3
    # in training autograd keeps the activations until backward: one read at the end
    assert len(engine_calls) == 1


@pytest.mark.parametrize("defer", [False, True])
def test_nothing_is_kept_alive_after_the_forward(path, defer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    DebugUnderflowOverflow(model, check="batch", defer=defer)
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o)))
    for _ in range(3):
        forward(model, torch.randn(2, 4))
    assert seen[-1]() is None  # the middle activation is freed once the forward is over


def test_defer_reads_inference_tensors_in_their_hooks(monkeypatch):
    # without version counters nothing can be shown unchanged
    monkeypatch.setattr(kinds, "CPU_AS_DEVICE", True)

    def inference(model, batch):
        with torch.inference_mode():
            model(batch)

    assert_identical(seeded(FixesUpOnTheBadStep), big(4, 2), steps=inference, check="batch", ours={"defer": True})


def test_stage_bytes_is_validated():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="stage_bytes"):
            DebugUnderflowOverflow(nn.Linear(2, 2), check="batch", stage_bytes=bad)


# -- reuse of rows within a pass, and its hole ----------------------------------------------------

class WritesThroughData(nn.Module):
    """Between two hooks that see the same tensor, the parent writes an inf through ``.data``,
    which bumps no version counter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Identity()

    def forward(self, x):
        y = self.a(x)
        if x.abs().max() > 100:
            y.data[0, 0] = INF
        return self.b(y)


@pytest.mark.parametrize("check", CHECKS)
def test_reuse_hole_a_write_that_bumps_no_version_between_two_hooks(path, check):
    data = with_value(batches(3), 1, 1000.0)
    # reuse off: every hook reads, as the reference does
    assert_identical(seeded(WritesThroughData), data, check=check, ours={"reuse_stats": False})
    # reuse on (the default): b's input is a's output and b returns it as the model's output, all
    # unchanged by their version counter, so a's row serves them: the inf written through .data
    # in between is never read (the documented hole of reuse_stats)
    got_out, got_outcomes, _ = run(DebugUnderflowOverflow, seeded(WritesThroughData), data, forward, check=check)
    assert got_outcomes == [None, None, None] and "has infs" not in got_out


# -- no input aborts the process ------------------------------------------------------------------

class Unloadable:
    """A lazy proxy whose target fails to load: isinstance() raises."""

    @property
    def __class__(self):
        raise RuntimeError("the proxy's target failed to load")


class Takes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, extra):
        return self.lin(x)


_HOSTILE = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_reads import Takes, Unloadable
    from overflow_fast import DebugUnderflowOverflow

    for check in ("module", "batch"):
        model = Takes()
        DebugUnderflowOverflow(model, check=check)
        try:
            model(torch.ones(1, 2), Unloadable())
        except Exception as error:
            print(check, type(error).__name__, error)
""")


def test_an_input_whose_isinstance_raises_raises_as_the_reference_does():
    from compat import ReferenceDetector

    model = Takes()
    ReferenceDetector(model)
    with pytest.raises(RuntimeError, match="the proxy's target failed to load"):
        model(torch.ones(1, 2), Unloadable())
    # ours in a child process: an abort (C++ throwing through C) must fail this test, not pytest
    child = subprocess.run([sys.executable, "-c", _HOSTILE, os.path.dirname(__file__)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.splitlines() == [f"{check} RuntimeError the proxy's target failed to load"
                                         for check in CHECKS]


_ENTRY_POINTS = textwrap.dedent("""
    import torch
    from overflow_fast import tensor_stats
    from overflow_fast.stats.cpu_backend import extension
    from overflow_fast.stats import triton_backend

    class Unloadable:
        @property
        def __class__(self):
            raise RuntimeError("isinstance raised")

    class BadList(list):
        def __len__(self):
            raise RuntimeError("len raised")
        def __iter__(self):
            raise RuntimeError("iter raised")

    C = extension()
    x = torch.ones(3)
    calls = {
        "compute": lambda arg: C.compute(arg),
        "compute out": lambda arg: C.compute(arg, torch.zeros(1, 8, dtype=torch.int64)),
        "triton_table": lambda arg: C.triton_table(arg, (torch.Tensor, torch.nn.Parameter), x.device, {}, 32,
                                                   torch.zeros(16, dtype=torch.int64), 1, 0, 0, False),
        "HookCore.add": lambda arg: C.hooks.HookCore(8, 0, 8).add(arg, -1, False),
        "HookCore.add site": lambda arg: C.hooks.HookCore(8, 1 << 20, 8).add(arg, 7, True),
        "torch op": lambda arg: torch.ops.overflow_fast.tensor_stats(arg),
        "torch op out": lambda arg: torch.ops.overflow_fast.tensor_stats_out(arg, torch.zeros(2, 8, dtype=torch.int64)),
        "tensor_stats": lambda arg: tensor_stats(arg),
    }
    for name, call in calls.items():
        for label, arg in (("proxy", [x, Unloadable()]), ("bad list", BadList([x])), ("not a list", Unloadable()),
                           ("none", [None]), ("int", 3)):
            try:
                result = call(arg)
            except Exception as error:
                print("raised", name, label, type(error).__name__)
            else:
                print("returned", name, label, result)
""")


@pytest.mark.skipif(cpu_backend.extension() is None, reason="the C++ extension is unavailable")
def test_native_entry_points_raise_python_errors_on_hostile_inputs():
    # in a child process: an abort must fail this test, not kill pytest
    child = subprocess.run([sys.executable, "-c", _ENTRY_POINTS], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert len(lines) == 8 * 5, lines
    # each raises a Python exception; the Triton table builder may instead decline (None: the caller
    # then takes the general path, which raises)
    unexpected = [line for line in lines if not line.startswith("raised")
                  and not (line.startswith("returned triton_table") and line.endswith(" None"))]
    assert unexpected == []
