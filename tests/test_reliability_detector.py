"""Reliability of the detector in the setups people train with.

Each test compares with the reference (``transformers.debug_utils.DebugUnderflowOverflow``) byte for
byte where the reference defines the behaviour, in both check modes:

- item 2: the reuse cache never serves a stale row (gradient checkpointing re-running modules in
  backward, fused optimizers that write weights without bumping ``_version``, a submodule driven on
  its own, a forward that raised) and ``remove()`` lets go of every tensor;
- item 5: one detector used from two threads at once;
- item 6: with check="batch", a nan first produced by a module re-run in backward is reported
  inside ``backward()``;
- item 7: no silent per-tensor slow path when the chosen backend cannot run;
- item 8: every argument value the reference accepts;
- item 9: pickling/copying a model carries no device buffer, reports are flushed, two detectors
  print one report, ``tensor_stats`` rejects an ``out`` that overlaps an input.
"""

import contextlib
import copy
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import overflow_fast
from compat import ReferenceDetector, _first_difference, forward, run
from overflow_fast import DebugUnderflowOverflow, tensor_stats
from test_compat_rules import Scaled, batches, make, with_value
from test_detector import capture

CHECKS = ["module", "batch"]
NAN = float("nan")
OVERFLOW_ERROR = (
    "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
    "Please scroll up above this traceback to see the activation values prior to this event."
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(overflow_fast.__file__)))


# -- helpers ------------------------------------------------------------------------------------

# Fused optimizers write the parameters in one kernel without bumping their version counter.
OPTIMIZERS = {
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.1, fused=True),
}


def assert_fused_step_keeps_version(optimizer):
    """The premise of the stale-row tests: a fused step changes the values, even to nan, without
    bumping ``_version`` (so a version check alone cannot see the change)."""
    layer = make(nn.Linear, 4, 4)
    opt = OPTIMIZERS[optimizer](layer.parameters())
    layer(torch.ones(2, 4)).sum().backward()
    version, before = layer.weight._version, layer.weight.detach().clone()
    opt.step()
    assert layer.weight._version == version and not torch.equal(before, layer.weight.detach())
    layer.weight.grad.fill_(NAN)
    opt.step()
    assert layer.weight._version == version and layer.weight.isnan().all()


class PerModel:
    """One optimizer per model (run() gives each detector its own copy of the model)."""

    def __init__(self, optimizer, parameters=lambda model: model.parameters()):
        self.optimizer = optimizer
        self.parameters = parameters
        self.by_model = {}

    def __call__(self, model):
        # keyed by the model itself, which this keeps alive: an id() could be reused by the next copy
        if model not in self.by_model:
            self.by_model[model] = OPTIMIZERS[self.optimizer](list(self.parameters(model)))
        return self.by_model[model]


def three_runs(model, data, steps, check, **kwargs):
    """(reference, ours, ours with reuse_stats=False): (stdout, outcomes) of each, on copies of model."""
    want = run(ReferenceDetector, copy.deepcopy(model), data, steps, **kwargs)[:2]
    got = run(DebugUnderflowOverflow, copy.deepcopy(model), data, steps, check=check, **kwargs)[:2]
    control = run(DebugUnderflowOverflow, copy.deepcopy(model), data, steps, check=check, reuse_stats=False,
                  **kwargs)[:2]
    return want, got, control


def assert_same(got, want):
    """Two (stdout, outcomes) captures are identical; on failure, say where the text differs."""
    assert got[1] == want[1]
    assert got[0] == want[0], _first_difference(got[0], want[0])


def all_distinct_weights(out):
    """Every ``weight`` line of ``out`` differs from the others (the weights really move)."""
    lines = [line for line in out.splitlines() if line.endswith(" weight")]
    return len(lines) > 1 and len(set(lines)) == len(lines)


def child_env():
    """The environment of a child Python that imports this very overflow_fast."""
    env = dict(os.environ)
    for name in ("PYTHONUNBUFFERED", "TRITON_INTERPRET", "OVERFLOW_FAST_BACKEND"):
        env.pop(name, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- item 2: stale rows from the reuse cache -----------------------------------------------------

class Checkpointed(nn.Module):
    """A block under gradient checkpointing first: its modules run again during backward."""

    def __init__(self, reentrant):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


# "non_reentrant_early_stop" is torch's default; there the reference's own abs()/min() calls in its
# hook are saved tensors that stop the recomputation inside its hook, so its text cannot be matched:
# that route is compared with reuse_stats=False only.
CHECKPOINT_ROUTES = ["reentrant", "non_reentrant", "non_reentrant_early_stop"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("route", CHECKPOINT_ROUTES)
def test_checkpoint_recompute_then_fused_step_nan_weight_is_reported(check, optimizer, route):
    # batch 0 trains with nan gradients: the fused step writes nan into every weight (no version
    # bump) after backward re-ran the checkpointed block; batch 1's forward must see the nan weights
    assert_fused_step_keeps_version(optimizer)
    optimizers = PerModel(optimizer)

    def steps(model, batch):
        x, poison = batch
        opt = optimizers(model)
        opt.zero_grad()
        model(x.clone().requires_grad_()).sum().backward()
        if poison:
            for p in model.parameters():
                p.grad.fill_(NAN)
        opt.step()

    data = [(x, i == 0) for i, x in enumerate(batches(2))]
    with set_checkpoint_early_stop(route == "non_reentrant_early_stop"):
        want, got, control = three_runs(make(Checkpointed, route == "reentrant"), data, steps, check)
    assert control[1][1] == ("ValueError", OVERFLOW_ERROR)
    assert control[0].startswith("weight has nans\nbias has nans\noutput has nans\n")
    if route != "non_reentrant_early_stop":
        assert_same(control, want)  # the control agrees with the reference
    assert_same(got, control)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_submodule_driven_alone_prints_current_weights(check, optimizer):
    # the top-level model never runs (batch_number stays 0, traced: every frame is printed at once)
    assert_fused_step_keeps_version(optimizer)
    optimizers = PerModel(optimizer, lambda model: model.layers[0].parameters())

    def steps(model, x):
        opt = optimizers(model)
        opt.zero_grad()
        model.layers[0](x).sum().backward()
        opt.step()

    want, got, control = three_runs(make(Scaled, depth=2), batches(4), steps, check, trace_batch_nums=[0])
    assert_same(control, want)
    assert all_distinct_weights(want[0])
    assert_same(got, want)


class MayRaise(nn.Module):
    """A forward that can fail midway, after its first module ran."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.fail = False

    def forward(self, x):
        y = self.a(x)
        if self.fail:
            raise RuntimeError("the forward failed midway")
        return self.b(y)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_forward_that_raised_then_fused_step_prints_current_weights(check, optimizer):
    assert_fused_step_keeps_version(optimizer)
    optimizers = PerModel(optimizer)
    x = batches(1)[0]

    def steps(model, action):
        opt = optimizers(model)
        if action == "train":
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        elif action == "raise":
            model.fail = True
            try:
                model(x)
            finally:
                model.fail = False
        elif action == "step":  # again with the last gradients
            opt.step()
        else:
            forward(model, x)

    # traced, so every frame is printed as it is made, a.weight included, in both check modes
    data = ["train", "raise", "step", "forward", "step", "forward"]
    want, got, control = three_runs(make(MayRaise), data, steps, check, trace_batch_nums=[0, 1, 2, 3])
    assert want[1] == [None, ("RuntimeError", "the forward failed midway"), None, None, None, None]
    assert_same(control, want)
    assert all_distinct_weights(want[0])
    assert_same(got, want)


@pytest.mark.parametrize("check", CHECKS)
def test_remove_lets_go_of_every_tensor(check):
    # a submodule run on its own (traced, so its rows are read at once), then remove(): the detector
    # must hold no weak reference to the model's tensors (swap_tensors refuses a tensor that has one)
    model = make(Scaled, depth=2)
    detector = DebugUnderflowOverflow(model, check=check, trace_batch_nums=[0])
    out, error = capture(lambda: model.layers[0](torch.ones(2, 4)))
    assert error is None and "layers.0 Linear" in out
    detector.remove()
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.half()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    # the detector is still alive here: nothing it holds may block the swap
    assert all(p.dtype == torch.float16 for p in model.parameters())
    del detector


# -- item 5: threads ----------------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_one_detector_two_threads(check):
    # two threads drive one model at once; thread 1's input carries a nan at forward `bad`. After
    # that the flag sticks and every forward of both threads raises (and prints) again, so the
    # reports of the two threads overlap too
    forwards, bad = 240, 120
    model = make(nn.Sequential, nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    # a long ring: the report of one thread takes a while to print while the other keeps running
    DebugUnderflowOverflow(model, check=check, max_frames_to_save=1000)
    barrier = threading.Barrier(2)
    errors = {0: [], 1: []}  # per thread: (forward index, exception)

    def work(thread):
        generator = torch.Generator().manual_seed(thread)
        barrier.wait()
        for i in range(forwards):
            x = torch.randn(2, 4, generator=generator)
            if thread == 1 and i == bad:
                x[0, 0] = NAN
            try:
                with torch.no_grad():
                    model(x)
            except Exception as error:  # noqa: BLE001 - every exception is recorded and judged
                errors[thread].append((i, error))

    out = io.StringIO()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: hooks of the two forwards interleave
    try:
        with contextlib.redirect_stdout(out):
            threads = [threading.Thread(target=work, args=(t,)) for t in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)

    unexpected = [(t, i, f"{type(e).__name__}: {e}") for t in (0, 1) for i, e in errors[t]
                  if not (isinstance(e, ValueError) and str(e) == OVERFLOW_ERROR)]
    assert unexpected[:3] == []
    # the nan is reported in the forward that carried it, in the thread that ran it
    assert errors[1] and errors[1][0][0] == bad
    text = out.getvalue()
    assert text.startswith("input[0] has nans\n") and "\nDetected inf/nan during batch_number=" in text


# -- item 6: hooks that run during backward ------------------------------------------------------

class RecomputedInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=True))


@pytest.mark.parametrize("check", CHECKS)
def test_nan_first_seen_in_backward_recompute_raises_inside_backward(check):
    # the forward is clean; a weight goes nan between forward and backward, so only the re-run of
    # the checkpointed block in backward sees it: the error must come out of loss.backward()
    marks = []

    def steps(model, x):
        loss = model(x.clone().requires_grad_()).sum()
        with torch.no_grad():
            model.block[0].weight[1, 2] = NAN
        marks.append("backward")
        loss.backward()
        marks.append("backward returned")

    data = batches(2)
    want = run(ReferenceDetector, make(RecomputedInBackward), data, steps)[:2]
    assert marks == ["backward"] and want[1][0] == ("ValueError", OVERFLOW_ERROR)
    assert "weight has nans" in want[0]
    module = run(DebugUnderflowOverflow, make(RecomputedInBackward), data, steps, check="module")[:2]
    assert_same(module, want)
    marks.clear()
    got = run(DebugUnderflowOverflow, make(RecomputedInBackward), data, steps, check=check)[:2]
    assert marks == ["backward"]  # raised before backward() returned
    assert_same(got, want)


# -- item 7: no silent slow path ----------------------------------------------------------------

_TRITON_CHILD = """
import json, sys, warnings
import torch
from torch import nn
from overflow_fast import DebugUnderflowOverflow
from overflow_fast.stats import tensor_stats as real_tensor_stats

engine_calls = [0]

def counting(*args, **kwargs):
    engine_calls[0] += 1
    return real_tensor_stats(*args, **kwargs)

# count every call into the engine, from whichever overflow_fast module makes it
for name, module in list(sys.modules.items()):
    if name.startswith("overflow_fast") and getattr(module, "tensor_stats", None) is real_tensor_stats:
        module.tensor_stats = counting
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
result = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        detector = DebugUnderflowOverflow(model, backend="triton", check=sys.argv[1])
    except Exception as error:
        result["raised"] = [type(error).__name__, str(error)]
    result["construction_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    seen = len(caught)
    if "raised" not in result:
        for _ in range(3):
            model(torch.randn(2, 4))
        detector.flush()
        result["later_warnings"] = [str(w.message) for w in caught[seen:]
                                    if issubclass(w.category, RuntimeWarning)]
        result["engine_calls"] = engine_calls[0]
        result["hook_calls"] = detector.total_calls
print(json.dumps(result))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the triton backend runs here")
@pytest.mark.parametrize("check", CHECKS)
def test_triton_without_cuda_raises_or_warns_at_construction(check):
    # a child process: the triton backend fixes interpreter mode at import (TRITON_INTERPRET unset)
    child = subprocess.run([sys.executable, "-c", _TRITON_CHILD, check], capture_output=True, text=True,
                           env=child_env(), timeout=120)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    if "raised" in result:
        assert result["raised"][0] in ("ValueError", "RuntimeError") and "triton" in result["raised"][1]
        return
    warned = result["construction_warnings"]
    assert len(warned) == 1, f"neither raised nor warned at construction: {result}"
    assert "triton" in warned[0] and any(name in warned[0] for name in ("'torch'", "'cpu'", "torch", "cpu"))
    assert result["later_warnings"] == []  # once
    # what runs instead reads each hook call's tensors in one engine call, not one call per tensor
    assert 0 < result["engine_calls"] <= result["hook_calls"], result


@pytest.mark.parametrize("check", CHECKS)
def test_bad_backend_environment_variable_is_rejected_at_construction(check, monkeypatch):
    monkeypatch.setenv("OVERFLOW_FAST_BACKEND", "nonsense")
    model = make(Scaled, depth=1)
    with pytest.raises(ValueError, match="OVERFLOW_FAST_BACKEND"):
        DebugUnderflowOverflow(model, check=check)
    assert not model._forward_hooks and not model.layers[0]._forward_hooks
    assert not model._forward_pre_hooks and not model.layers[0]._forward_pre_hooks


# -- item 8: the reference's arguments -----------------------------------------------------------

class OnlyIter:
    """A user's collection that only iterates (``in`` works through ``__iter__``)."""

    def __init__(self, *items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


DROP_IN_ARGUMENTS = {
    "max_frames_none": dict(max_frames_to_save=None),
    "abort_numpy_int64": dict(abort_after_batch_num=np.int64(1)),
    "abort_numpy_uint8": dict(abort_after_batch_num=np.uint8(1)),
    "abort_tensor_0dim": dict(abort_after_batch_num=torch.tensor(1)),
    "trace_tuple": dict(trace_batch_nums=(1,)),
    "trace_set": dict(trace_batch_nums={1}),
    "trace_frozenset": dict(trace_batch_nums=frozenset({1, 5})),
    "trace_range": dict(trace_batch_nums=range(1, 2)),
    "trace_numpy": dict(trace_batch_nums=np.array([1])),
    "trace_iterable": dict(trace_batch_nums=OnlyIter(1)),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("arguments", sorted(DROP_IN_ARGUMENTS))
def test_arguments_the_reference_accepts(check, arguments):
    kwargs = DROP_IN_ARGUMENTS[arguments]
    data = with_value(batches(4), 3, NAN)  # three clean batches, then a nan
    want = run(ReferenceDetector, make(Scaled, depth=2), data, forward, **kwargs)[:2]
    got = run(DebugUnderflowOverflow, make(Scaled, depth=2), data, forward, check=check, **kwargs)[:2]
    assert want[1][-1] == ("ValueError", OVERFLOW_ERROR)
    if arguments.startswith("abort"):
        assert want[1][1] == ("ValueError", "DebugUnderflowOverflow: aborting after 2 batches due to "
                                            "`abort_after_batch_num=1` arg")
    if arguments == "max_frames_none":
        assert "Last 10 forward frames:" in want[0]  # every frame since the start
    if arguments.startswith("trace"):
        assert "*** Starting batch number=1 ***" in want[0] and "layers.0 Linear" in want[0]
    assert_same(got, want)


# -- item 9: small things users hit --------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_pickling_and_copying_a_model_carries_no_device_buffer(check):
    model = make(Scaled, depth=2)
    DebugUnderflowOverflow(model, check=check)
    x = batches(1)[0]
    bad = with_value([x], 0, NAN)[0]
    assert capture(lambda: model(x)) == ("", None)  # a forward has run: the detector's buffers exist

    pickled = pickle.dumps(model)
    saved = io.BytesIO()
    torch.save(model, saved)
    # the model is 4 small Linear layers: a few kB (the check="batch" device buffer alone is 4 MiB)
    assert len(pickled) < 200_000 and len(saved.getvalue()) < 200_000, (len(pickled), len(saved.getvalue()))

    saved.seek(0)
    copies = {"pickle": pickle.loads(pickled), "torch.save": torch.load(saved, weights_only=False),
              "deepcopy": copy.deepcopy(model)}
    # the original, then each copy: one clean forward, then a nan (the copies start from its state)
    assert capture(lambda: model(x)) == ("", None)
    want_out, want_error = capture(lambda: model(bad))
    assert str(want_error) == OVERFLOW_ERROR and "input[0] has nans" in want_out
    for route, clone in copies.items():
        assert capture(lambda: clone(x)) == ("", None), route
        got_out, got_error = capture(lambda: clone(bad))
        assert str(got_error) == OVERFLOW_ERROR and got_out == want_out, route



@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("route", ["deepcopy", "pickle"])
def test_copying_a_model_mid_pass_is_refused_clearly(check, route):
    model = make(Scaled, depth=2)
    DebugUnderflowOverflow(model, check=check, backward=True)
    x = batches(1)[0]
    copy_now = {"deepcopy": copy.deepcopy, "pickle": pickle.dumps}[route]

    def copies_inside_the_forward(module, args, output):  # the model's first call is still running
        copy_now(model)

    handle = model.layers[0].register_forward_hook(copies_inside_the_forward)
    with pytest.raises(RuntimeError, match="cannot be copied or pickled while a forward or backward pass runs"):
        model(x)
    handle.remove()
    if check == "batch":  # a gradient hook copying mid-backward, while the backward pass's calls wait
        weight = next(module.weight for module in model.modules() if isinstance(module, nn.Linear))
        handle = weight.register_post_accumulate_grad_hook(lambda parameter: copy_now(model) and None)
        with pytest.raises(RuntimeError, match="cannot be copied or pickled while a forward or backward pass runs"):
            model(x).sum().backward()
        handle.remove()
    # between steps it copies, and the copy and the original go on checking
    model.zero_grad()
    model(x).sum().backward()
    clone = copy.deepcopy(model) if route == "deepcopy" else pickle.loads(pickle.dumps(model))
    bad = with_value([x], 0, NAN)[0]
    for watched in (model, clone):
        out, error = capture(lambda: watched(bad))
        assert str(error) == OVERFLOW_ERROR and "input[0] has nans" in out


_FLUSH_CHILD = """
import os, signal, sys
import torch
from torch import nn
from overflow_fast import DebugUnderflowOverflow

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
DebugUnderflowOverflow(model, check=sys.argv[1])
x = torch.ones(2, 4)
model(x)
x[1, 2] = float("nan")
try:
    model(x)
except ValueError:
    os.kill(os.getpid(), signal.SIGKILL)  # a launcher killing the rank right after the error
"""


@pytest.mark.parametrize("check", CHECKS)
def test_report_is_flushed_before_the_process_dies(check, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    bad = torch.ones(2, 4)
    bad[1, 2] = NAN
    want_out, want_outcomes, _ = run(ReferenceDetector, model, [torch.ones(2, 4), bad], forward)
    assert want_outcomes == [None, ("ValueError", OVERFLOW_ERROR)]

    path = tmp_path / "stdout.txt"
    with open(path, "wb") as stdout:  # a file: block-buffered, PYTHONUNBUFFERED removed
        child = subprocess.run([sys.executable, "-c", _FLUSH_CHILD, check], stdout=stdout,
                               stderr=subprocess.PIPE, env=child_env(), timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert path.read_text() == want_out


def two_detectors(cls):
    def attach(model, **kwargs):
        cls(model, **kwargs)
        return cls(model, **kwargs)

    return attach


@pytest.mark.parametrize("check", CHECKS)
def test_two_detectors_on_one_model_print_one_report(check):
    data = with_value(batches(3), 2, NAN)
    want = run(two_detectors(ReferenceDetector), make(Scaled, depth=2), data, forward)[:2]
    assert want[0].count("Detected inf/nan") == 1
    assert want[1][-1] == ("ValueError", OVERFLOW_ERROR)
    module = run(two_detectors(DebugUnderflowOverflow), make(Scaled, depth=2), data, forward, check="module")[:2]
    assert_same(module, want)
    got = run(two_detectors(DebugUnderflowOverflow), make(Scaled, depth=2), data, forward, check=check)[:2]
    assert_same(got, want)


def _overlaps():
    a = torch.arange(8, dtype=torch.int64).reshape(1, 8) - 3
    big = torch.arange(32, dtype=torch.int64).reshape(4, 8) - 7
    buffer = torch.arange(16, dtype=torch.int64).reshape(2, 8) + 100
    return {
        "out_is_the_input": ([a], a, [a]),
        "out_is_a_slice_of_an_input": ([big], big[1:2], [big]),
        "an_input_is_a_slice_of_out": ([buffer[0, 2:6]], buffer[0:1], [buffer]),
        "out_overlaps_the_second_input": ([torch.ones(3), big[2]], big[1:3], [big]),
    }


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", sorted(_overlaps()))
def test_tensor_stats_rejects_out_overlapping_an_input(case, backend):
    tensors, out, watched = _overlaps()[case]
    before = [t.clone() for t in watched]
    with pytest.raises(ValueError, match="overlap"):
        tensor_stats(tensors, backend, out=out)
    for t, b in zip(watched, before):
        assert torch.equal(t, b)  # nothing was written
    # a disjoint out still works
    rows = torch.full((len(tensors), 8), -1, dtype=torch.int64)
    assert tensor_stats(tensors, backend, out=rows).tolist() == tensor_stats(tensors, backend).tolist()
