"""overflow_fast's own behaviour: deliberate differences from the reference, removable hooks,
bad arguments, and check="batch" (no host sync in hooks, nothing lost when a forward fails)."""

import contextlib
import io

import pytest
import torch
from torch import nn

from compat import HostReads, ReferenceDetector, run
from compat import capture as compat_capture
import overflow_fast.stats.kinds
import overflow_fast.stats.torch_backend
from overflow_fast import DebugUnderflowOverflow
from test_compat_rules import Scaled, batches, make, with_value

NAN = float("nan")


def capture(fn):
    return compat_capture(fn, Exception)


class EmptyAndBool(nn.Module):
    def forward(self, x):
        return x[:0], x > 0, x


@pytest.mark.parametrize("check", ["module", "batch"])
def test_empty_and_bool_tensors_get_a_line_instead_of_a_crash(check):
    reference_model = EmptyAndBool()
    ReferenceDetector(reference_model, trace_batch_nums=[0])
    with pytest.raises(RuntimeError), contextlib.redirect_stdout(io.StringIO()):
        reference_model(torch.tensor([1.0, -2.0]))  # the reference crashes on the empty tensor

    model = EmptyAndBool()
    DebugUnderflowOverflow(model, trace_batch_nums=[0], check=check)
    out, error = capture(lambda: model(torch.tensor([1.0, -2.0])))
    assert error is None
    assert "     empty tensor output[0]\n" in out
    assert "0.00e+00 1.00e+00 output[1]\n" in out
    assert "1.00e+00 2.00e+00 output[2]\n" in out


def test_unreadable_tensor_gets_a_clear_line():
    class Meta(nn.Module):
        def forward(self, x):
            return torch.empty(3, device="meta"), x

    model = Meta()
    DebugUnderflowOverflow(model, trace_batch_nums=[0])
    out, error = capture(lambda: model(torch.ones(2)))
    assert error is None
    assert "       unreadable output[0] (meta tensors hold no data)" in out


def test_engine_failure_does_not_crash_training(monkeypatch):
    import overflow_fast.hooks.reads as reads

    def broken(tensors, backend=None, out=None):
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(reads, "tensor_stats", broken)
    model = make(Scaled, depth=1)
    DebugUnderflowOverflow(model, trace_batch_nums=[0])
    out, error = capture(lambda: model(torch.ones(1, 4)))
    assert error is None
    assert "unreadable weight (RuntimeError: backend exploded)" in out


def test_ring_stays_bounded_after_tracing():
    # the reference turns its ring into an unbounded list after a traced batch; we keep the bound
    data = with_value(batches(6), 5, NAN)
    ref_out, _, _ = run(ReferenceDetector, make(Scaled, depth=2), data, lambda m, b: m(b),
                        max_frames_to_save=2, trace_batch_nums=[0])
    out, _, _ = run(DebugUnderflowOverflow, make(Scaled, depth=2), data, lambda m, b: m(b),
                    max_frames_to_save=2, trace_batch_nums=[0])
    assert "Last 13 forward frames:" in ref_out  # 4 clean batches of 3 frames, then the bad one
    assert "Last 2 forward frames:" in out


def test_remove_and_context_manager():
    model = make(Scaled, depth=2)
    with DebugUnderflowOverflow(model, trace_batch_nums=[0, 1, 2]):
        out, _ = capture(lambda: model(torch.ones(1, 4)))
        assert "layers.0 Linear" in out
    out, _ = capture(lambda: model(torch.ones(1, 4)))
    assert out == ""
    assert not model._forward_hooks and not model.layers[0]._forward_hooks
    assert not model._forward_pre_hooks and not model.layers[0]._forward_pre_hooks

    detector = DebugUnderflowOverflow(model, trace_batch_nums=[0])
    detector.remove()
    assert capture(lambda: model(torch.ones(1, 4)))[0] == ""


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"model": "not a module"}, TypeError, "torch.nn.Module"),
        ({"max_frames_to_save": "21"}, TypeError, "max_frames_to_save"),
        ({"max_frames_to_save": -1}, ValueError, "max_frames_to_save"),
        ({"trace_batch_nums": 3}, TypeError, "trace_batch_nums"),
        ({"trace_batch_nums": "13"}, TypeError, "trace_batch_nums"),
        ({"abort_after_batch_num": 1.5}, TypeError, "abort_after_batch_num"),
        ({"check": "steps"}, ValueError, "check"),
        ({"frames_every": 10}, ValueError, "frames_every"),
        ({"frames_every": 0, "check": "step"}, ValueError, "frames_every"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"backend": 3}, TypeError, "backend"),
        ({"buffer_rows": 0}, ValueError, "buffer_rows"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", nn.Linear(2, 2))
    with pytest.raises(error, match=message):
        DebugUnderflowOverflow(model, **kwargs)
    assert not getattr(model, "_forward_hooks", None)  # nothing was registered


def test_helpers_reject_non_tensors():
    from overflow_fast import detect_overflow, get_abs_min_max

    with pytest.raises(TypeError, match="expects a tensor"):
        get_abs_min_max([1.0], "x")
    with pytest.raises(TypeError, match="expects a tensor"):
        detect_overflow(None, "x")


# -- check="batch" ------------------------------------------------------------------------------

def test_batch_mode_hooks_never_read_the_device(monkeypatch):
    # an accelerator's rows are read to the host; CPU rows are written in host memory already
    monkeypatch.setattr(overflow_fast.stats.kinds, "CPU_AS_DEVICE", True)  # asked as a detector is made
    # the engine's own host reads too (the torch backend's, held as it loads)
    monkeypatch.setattr(overflow_fast.stats.torch_backend, "HOST_DEVICE_TYPES", frozenset())
    reads = HostReads()

    def forwards(check, count):
        """Per forward: the host reads made while its hooks ran (up to the model's own, whose
        end decides the pass), and those made when it ended."""
        model = make(Scaled, depth=3)
        in_hooks = []
        # registered before the detector's, so it runs before the detector ends the pass
        model.register_forward_hook(lambda *_: in_hooks.append(list(reads.names)))
        detector = DebugUnderflowOverflow(model, check=check, backend="torch")
        seen = []
        with reads:
            for x in batches(count):
                reads.names.clear()
                model(x)
                seen.append((in_hooks[-1], reads.names[len(in_hooks[-1]):]))
        return detector, seen

    detector, seen = forwards("batch", 3)
    assert [hooks for hooks, _ in seen] == [[]] * 3
    assert [at_end for _, at_end in seen] == [["cpu"]] * 3  # one device-to-host read per forward (one device)
    assert detector.total_calls == 3 * 4

    # the same instrument does see the reads of check="module", one per hook
    _, seen = forwards("module", 1)
    assert seen == [(["cpu"] * 3, ["cpu"])]


class FailsOnNaN(nn.Module):
    """A forward whose later op rejects NaN, after the module that produced it."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        y = self.first(x)
        if torch.isnan(y).any():
            raise RuntimeError("probabilities contain NaN")
        return self.second(y)


def test_batch_mode_reports_before_the_forward_error_propagates():
    x = torch.ones(2, 4)
    x[0, 0] = NAN
    module_model = make(FailsOnNaN)
    DebugUnderflowOverflow(module_model, check="module")
    want_out, want_error = capture(lambda: module_model(x))
    assert isinstance(want_error, ValueError)

    batch_model = make(FailsOnNaN)
    DebugUnderflowOverflow(batch_model, check="batch")
    got_out, got_error = capture(lambda: batch_model(x))
    assert isinstance(got_error, RuntimeError) and "NaN" in str(got_error)
    assert got_out == want_out
    assert "inf/nan was detected earlier in this forward" in " ".join(getattr(got_error, "__notes__", []))


def test_batch_mode_submodule_alone_decides_when_it_returns():
    x = torch.ones(2, 4)
    x[1, 2] = NAN
    module_model = make(Scaled, depth=2)
    DebugUnderflowOverflow(module_model, check="module")
    want_out, want_error = capture(lambda: module_model.layers[0](x))
    assert isinstance(want_error, ValueError)

    model = make(Scaled, depth=2)
    DebugUnderflowOverflow(model, check="batch")
    got_out, got_error = capture(lambda: model.layers[0](x))
    assert isinstance(got_error, ValueError)
    assert got_out == want_out


class RemovesItsDetector(nn.Module):
    """A forward that takes the detector off halfway, with a nan already seen and not yet decided."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.detector = None

    def forward(self, x):
        y = self.first(x)
        self.detector.remove()
        return self.second(y)


def test_batch_mode_remove_decides_on_the_pending_calls():
    x = torch.ones(2, 4)
    x[0, 0] = NAN
    model = make(RemovesItsDetector)
    model.detector = DebugUnderflowOverflow(model, check="batch")
    out, error = capture(lambda: model(x))
    assert isinstance(error, ValueError) and "input[0] has nans" in out and "first Linear" in out
    assert capture(lambda: model(x)) == ("", None)  # no hook left


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batch_mode_does_not_sync_on_cuda():
    model = make(Scaled, depth=3).cuda()
    DebugUnderflowOverflow(model, check="batch")
    x = torch.randn(3, 4, device="cuda")
    model(x)  # warm up: backend loading and the buffer allocation may sync once
    reads = {"n": 0}
    original = DebugUnderflowOverflow.flush

    def flush(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            reads["n"] += 1
            return original(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    DebugUnderflowOverflow.flush = flush
    try:
        torch.cuda.set_sync_debug_mode("error")
        for layer in model.layers:  # submodules alone: hooks only, no flush
            layer(x)
        torch.cuda.set_sync_debug_mode(0)
        model(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        DebugUnderflowOverflow.flush = original
    assert reads["n"] >= 1


class ManyCalls(nn.Module):
    """One forward: a bad call, then many calls without tensors, then a print."""

    def __init__(self):
        super().__init__()
        self.bad = nn.Identity()
        self.nothing = Nothing()

    def forward(self, x):
        self.bad(x)
        for _ in range(5):
            self.nothing()
        print("end of forward")


class Nothing(nn.Module):
    def forward(self):
        return None


@pytest.mark.parametrize("buffer_rows, decided_early", [(2, True), (64, False)])
def test_batch_mode_bounds_calls_without_tensors(buffer_rows, decided_early):
    # calls without tensors take no rows, but their frames wait all the same: at most buffer_rows
    # of them, then what waits is decided (here: the nan, before the forward's own print)
    x = torch.ones(2)
    x[0] = NAN
    model = ManyCalls()
    DebugUnderflowOverflow(model, check="batch", buffer_rows=buffer_rows)
    out, error = capture(lambda: model(x))
    assert isinstance(error, ValueError)
    assert ("end of forward" not in out) == decided_early
    assert "input[0] has nans" in out and "bad Identity" in out
