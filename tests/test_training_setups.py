"""The training setups people run, in the recommended mode too (``watch()``, check="batch"): activation
checkpointing (every route, transformers' own), torch.func transforms, the console's step line, and
several threads driving one model. Where the reference defines the behaviour, the text is compared
byte for byte; elsewhere the behaviour is asserted against ground truth."""

import contextlib
import copy
import io
import sys
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import models
from compat import ReferenceDetector, _first_difference, capture, run
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch

NAN = float("nan")
CHECKS = ["module", "batch"]
# how a block is checkpointed: torch's default (non-reentrant, stopping the recompute early by
# raising through it), non-reentrant without the early stop, and the reentrant autograd Function
ROUTES = ["non_reentrant_early_stop", "non_reentrant", "reentrant"]


def assert_same(got, want):
    assert got[1] == want[1]
    assert got[0] == want[0], _first_difference(got[0], want[0])


def route_context(route):
    return set_checkpoint_early_stop(False) if route == "non_reentrant" else contextlib.nullcontext()


class NanOnRecompute(nn.Module):
    """Finite in the forward, nan when activation checkpointing runs it again in backward."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * NAN if self.calls % 2 == 0 else x * 1.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(4, 4)
        self.act = NanOnRecompute()
        self.fc_out = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class Net(nn.Module):
    def __init__(self, route):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.block = Block()
        self.head = nn.Linear(4, 1)
        self.reentrant = route == "reentrant"

    def forward(self, x):
        return self.head(checkpoint(self.block, self.embed(x), use_reentrant=self.reentrant))


def train_steps(marks):
    def steps(model, x):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(x.clone().requires_grad_()).sum()
        marks.append("backward")
        loss.backward()
        marks.append("step")
        optimizer.step()
    return steps


def data(count=1):
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(2, 4, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_born_in_a_recompute_raises_inside_backward(route, check):
    marks = []
    with route_context(route):
        if route != "non_reentrant_early_stop":
            # the reference's own ops in its hook would stop the recompute early (they are saved
            # tensors): its text is defined on the other routes only
            want = run(ReferenceDetector, Net(route), data(), train_steps(marks))[:2]
            assert marks == ["backward"] and want[1][0] == ("ValueError", want[1][0][1])
            marks.clear()
        model = Net(route)
        before = [p.detach().clone() for p in model.parameters()]
        got = run(DebugUnderflowOverflow, model, data(), train_steps(marks), check=check)[:2]
    assert marks == ["backward"]  # raised inside backward(): the optimizer never stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert got[0].count("Detected inf/nan") == 1 and "output has nans" in got[0]
    if route != "non_reentrant_early_stop":
        assert_same(got, want)


@pytest.mark.parametrize("route", ROUTES)
def test_watch_reports_a_recomputed_nan_once_and_names_its_source(route):
    marks = []
    model = Net(route)
    with route_context(route):
        out, outcomes, detector = run(watch, model, data(), train_steps(marks))
    assert marks == ["backward"] and outcomes[0][0] == "ValueError"
    assert out.count("Detected inf/nan") == 1
    assert out.count("Source:") == 1 and "Source: born in forward of block.act (NanOnRecompute)" in out
    assert detector.batch_number == 1  # the recompute counted no batch


class InfGradient(torch.autograd.Function):
    """Identity forward; its backward makes the gradient inf."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * float("inf")


class InfGradientBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(4, 4)
        self.fc_out = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc_out(InfGradient.apply(self.fc_in(x)))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("check", CHECKS)
def test_an_inf_gradient_in_a_checkpointed_block_gives_one_report_of_its_first_frame(route, check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    block = InfGradientBlock()
    reentrant = route == "reentrant"

    def steps(_, x):
        hidden = checkpoint(block, model[0](x.clone().requires_grad_()), use_reentrant=reentrant)
        model[2](model[1](hidden)).sum().backward()

    root = nn.ModuleDict({"model": model, "block": block})
    with route_context(route):
        out, outcomes, detector = run(watch, root, data(1), steps, check=check)
    assert outcomes == [("ValueError", outcomes[0][1])]
    assert out.count("Detected inf/nan") == 1 and out.count("Source:") == 1
    # the first non-finite gradient is the one InfGradient made, arriving at fc_in's output
    assert "Source: born in backward, in the gradient arriving at block.fc_in (Linear) output.grad" in out


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("check", CHECKS)
def test_transformers_gradient_checkpointing_raises_inside_backward(reentrant, check):
    marks = []

    def steps(model, batch):
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[0, 0] = NAN  # only the recompute sees it
        marks.append("backward")
        loss.backward()
        marks.append("returned")

    def model():
        gpt2 = models.gpt2(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        gpt2.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return gpt2

    batches = [models.token_batch(0)]
    with set_checkpoint_early_stop(False):  # the reference's text is defined without the early stop
        want = run(ReferenceDetector, model(), batches, steps)[:2]
        assert marks == ["backward"]
        marks.clear()
        got = run(DebugUnderflowOverflow, model(), batches, steps, check=check)[:2]
    assert marks == ["backward"]
    assert_same(got, want)
    marks.clear()
    out, outcomes, _ = run(watch, model(), batches, steps)  # torch's default: early stop
    assert marks == ["backward"] and outcomes[0][0] == "ValueError" and out.count("Detected inf/nan") == 1


def test_a_recomputed_model_counts_its_batch_once():
    # the model's own forward is recomputed in backward (the whole model checkpointed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    detector = watch(model)
    for x in data(3):
        checkpoint(model, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert detector.batch_number == 3
    detector.remove()


# -- torch.func -----------------------------------------------------------------------------------

def functional_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model, params


def loss_of(model):
    return lambda params, x: functional_call(model, params, (x,)).sum()


TRANSFORMS = {
    "grad": lambda model, params, x: grad(loss_of(model))(params, x),
    "vmap_grad": lambda model, params, x: vmap(grad(loss_of(model)), in_dims=(None, 0))(params, x.unsqueeze(1)),
    "jacrev": lambda model, params, x: jacrev(loss_of(model))(params, x),
    "functional_call": lambda model, params, x: functional_call(model, params, (x,)),
    "vmap": lambda model, params, x: vmap(lambda row: functional_call(model, params, (row,)))(x),
}


def same_results(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_results(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("options", [{"check": "module"}, {"check": "batch"}, {"watch": True}],
                         ids=["module", "batch", "watch"])
def test_torch_func_transforms_run_unchanged_under_the_detector(transform, options):
    model, params = functional_model()
    x = data(1)[0]
    want = TRANSFORMS[transform](model, params, x)
    versions = {name: p._version for name, p in params.items()}
    options = dict(options)
    detector = watch(model) if options.pop("watch", False) else DebugUnderflowOverflow(model, **options)
    out, error = capture(lambda: TRANSFORMS[transform](model, params, x))
    got = TRANSFORMS[transform](model, params, x)
    detector.remove()
    assert error is None and out == ""
    assert same_results(got, want)
    assert {name: p._version for name, p in params.items()} == versions  # nothing written


@pytest.mark.parametrize("transform", ["grad", "jacrev", "functional_call"])
@pytest.mark.parametrize("check", CHECKS)
def test_torch_func_detects_as_the_reference_does(transform, check):
    def steps(model, x):
        TRANSFORMS[transform](model, params, x)

    bad = data(1)[0]
    bad[1, 2] = NAN
    model, params = functional_model()
    want = run(ReferenceDetector, copy.deepcopy(model), [data(1)[0], bad], steps)[:2]
    assert want[1][1][0] == "ValueError"
    got = run(DebugUnderflowOverflow, copy.deepcopy(model), [data(1)[0], bad], steps, check=check)[:2]
    assert_same(got, want)


@pytest.mark.parametrize("check", CHECKS)
def test_under_vmap_a_line_covers_every_instance(check):
    # the reference cannot run under vmap (its .item() of a batched tensor); here each line holds
    # the abs min and max over every instance of the batch
    model, params = functional_model()
    x = data(1)[0]
    detector = DebugUnderflowOverflow(model, check=check, trace_batch_nums=[0])
    out, error = capture(lambda: vmap(lambda row: functional_call(model, params, (row,)))(x))
    detector.remove()
    assert error is None
    lines = out.splitlines()
    first = lines.index(" " * 17 + " 0 Linear")
    assert lines[first + 3] == f"{x.abs().min():8.2e} {x.abs().max():8.2e} input[0]"
    output = model[0](x)
    assert lines[first + 4] == f"{output.abs().min():8.2e} {output.abs().max():8.2e} output"
    bad = x.clone()
    bad[1, 2] = NAN
    DebugUnderflowOverflow(model, check=check)
    out, error = capture(lambda: vmap(lambda row: functional_call(model, params, (row,)))(bad))
    assert isinstance(error, OverflowDetected) and error.module_name == "0" and "input[0] has nans" in out


def test_under_functionalize_the_values_after_in_place_updates_are_read():
    class InPlace(nn.Module):
        def forward(self, x):
            y = x.clone()
            y[:1].mul_(NAN)  # functionalize applies this to y lazily
            return y

    model = nn.Sequential(InPlace(), nn.Identity())
    DebugUnderflowOverflow(model, check="batch")
    out, error = capture(lambda: torch.func.functionalize(model)(torch.ones(2, 2)))
    assert isinstance(error, OverflowDetected) and error.module_name == "0" and "output has nans" in out


def test_a_transformed_tensor_that_cannot_be_opened_gets_a_line(monkeypatch):
    import overflow_fast.hooks.frames as frames

    class Closed:
        """functorch's own functions, except that no wrapper opens."""

        def __getattr__(self, name):
            return getattr(torch._C._functorch, name)

        @staticmethod
        def get_unwrapped(tensor):
            raise RuntimeError("no way in")

    model, params = functional_model()
    DebugUnderflowOverflow(model, check="batch", trace_batch_nums=[0])
    monkeypatch.setattr(frames, "_functorch", Closed())
    out, error = capture(lambda: grad(loss_of(model))(params, data(1)[0]))
    assert error is None
    assert "unreadable input[0] (a torch.func transform's tensor that cannot be unwrapped (RuntimeError: no way in))" \
        in out


# -- the console names the trainer's step -----------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_the_report_names_the_step_when_it_is_known(check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    reference_model = copy.deepcopy(model)
    bad = data(1)[0]
    bad[0, 0] = NAN
    batches = data(5) + [bad]
    want = run(ReferenceDetector, reference_model, batches, lambda m, x: m(x))[:2]
    detector = DebugUnderflowOverflow(model, check=check)
    outs = []
    for index, x in enumerate(batches):
        detector.set_step(index // 2, "train")  # gradient accumulation 2
        outs.append(capture(lambda: model(x))[0])
    # the reference's text, then one line
    assert "".join(outs) == want[0] + "Step: optimizer step 2 (train), batch_number 5\n"
    detector.set_step(7)
    out, _ = capture(lambda: model(bad))
    assert out.endswith("\nStep: optimizer step 7, batch_number 5\n")  # the forward that raised counted no batch


# -- threads --------------------------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("on_detect", ["record", "warn"])
def test_the_detection_count_is_exact_with_several_threads(check, on_detect):
    # many short runs, threads switching as often as Python lets them: each forward that carries a
    # nan is one detection, whatever interleaving the hooks of the threads take
    threads, forwards, runs = 3, 30, 12
    bad = {(0, 5), (1, 5), (1, 17), (2, 29), (0, 12)}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for attempt in range(runs):
            torch.manual_seed(attempt)
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
            detector = DebugUnderflowOverflow(model, check=check, on_detect=on_detect, kwargs=True,
                                              containers=True)
            barrier = threading.Barrier(threads)
            failures = []

            def work(thread):
                generator = torch.Generator().manual_seed(thread)
                barrier.wait()
                try:
                    for i in range(forwards):
                        x = torch.randn(2, 4, generator=generator)
                        if (thread, i) in bad:
                            x[1, 3] = NAN
                        with torch.no_grad():
                            model(x)
                except BaseException as error:  # noqa: BLE001 - judged below
                    failures.append(error)

            with contextlib.redirect_stdout(io.StringIO()), pytest.warns(RuntimeWarning) \
                    if on_detect == "warn" else contextlib.nullcontext():
                workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
            assert failures == []
            found = detector.detections
            assert len(found) == len(bad), (attempt, found)
            assert all(d["module"] == "0" and d["entries"] == ["input[0]", "output"] for d in found), [(d["module"], d["entries"]) for d in found]
            assert detector.total_calls == threads * forwards * 6
            detector.remove()
    finally:
        sys.setswitchinterval(interval)
