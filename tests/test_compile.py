"""torch.compile with the detector attached: no graph break (the model's own hook, which reads the
rows and decides, runs eagerly after the graph), no recompiles from batch to batch, and exactly
the report eager prints."""

import contextlib
import io

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.utils import counters

import models
from overflow_fast import DebugUnderflowOverflow, _compat, watch

INF = float("inf")


class MLP(nn.Sequential):
    """A model with a forward of its own, as users' and transformers' models have."""

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


class GraphBreak(nn.Module):
    """A layer whose forward breaks the graph: the frame around it is lost, and the modules called
    around it run from code that dynamo does not trace."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return x * 1


def mlp(model_class=MLP, *extra):
    torch.manual_seed(0)
    return model_class(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(), *extra,
                       nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 8), nn.Softmax(-1))


def mlp_batches(bad_at=2):
    torch.manual_seed(1)
    data = [torch.randn(4, 16) for _ in range(4)]
    if bad_at is not None:
        data[bad_at][1, 3] = INF
    return data


def attach(model, variant):
    if variant == "watch":
        return watch(model)
    return DebugUnderflowOverflow(model, check=variant, max_frames_to_save=6)


def run(fn, batches, train=False):
    """stdout and the error (message start) or None of each batch."""
    out = io.StringIO()
    outcomes = []
    with contextlib.redirect_stdout(out):
        for batch in batches:
            try:
                if train:
                    fn(batch).sum().backward()
                else:
                    with torch.no_grad():
                        fn(batch)
                outcomes.append(None)
            except ValueError as error:
                outcomes.append(str(error).splitlines()[0])
    return out.getvalue(), outcomes


def eager_report(variant, batches, train=False, make=mlp):
    """What the uncompiled model with the detector prints (``run``'s result), to compare with."""
    model = make()
    attach(model, variant)
    return run(model, batches, train)


# the claim holds from the torch that compiles a watched model whole (overflow_fast/_compat.py)
whole_graphs = pytest.mark.skipif(not _compat.COMPILES_A_WATCHED_MODEL_WHOLE,
                                  reason="this torch compiles a model with a detector eagerly or in pieces")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


@whole_graphs
@pytest.mark.parametrize("variant", ["batch", "module", "watch"])
def test_no_graph_break(variant):
    model = mlp()
    assert dynamo.explain(model)(mlp_batches(None)[0]).graph_break_count == 0
    attach(model, variant)
    dynamo.reset()
    explained = dynamo.explain(model)(mlp_batches(None)[0])
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1


@whole_graphs
@pytest.mark.parametrize("variant", ["kwargs and containers", "watch"])
def test_no_graph_break_on_a_transformers_model(variant):
    model = models.gpt2().eval()
    ids = models.token_batch(0)
    if variant == "watch":
        watch(model)
    else:
        DebugUnderflowOverflow(model, check="batch", kwargs=True, containers=True)
    explained = dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("variant", ["batch", "module"])
@pytest.mark.parametrize("bad_at", [None, 0, 2])
def test_compiled_model_prints_what_eager_prints(variant, bad_at):
    want = eager_report(variant, mlp_batches(bad_at))
    model = mlp()
    detector = attach(model, variant)
    got = run(torch.compile(model, backend="aot_eager"), mlp_batches(bad_at))
    assert got == want
    assert (bad_at is None) == (want[1] == [None] * 4)
    assert detector.total_calls > 0


def test_inductor_compiled_model_prints_what_eager_prints():
    want = eager_report("batch", mlp_batches(2))
    model = mlp()
    attach(model, "batch")
    got = run(torch.compile(model), mlp_batches(2))
    assert got == want and "has infs" in got[0]


@whole_graphs
@pytest.mark.parametrize("without, compiler", [("the kernel's op", "inductor"), ("backend='torch'", "aot_eager")])
def test_the_torch_backends_ops_trace_whole_where_the_kernels_op_is_not_taken(monkeypatch, without, compiler):
    # no C++ extension (no compiler), or the torch backend asked for: the reads under the tracer
    # are the torch backend's ops, with no graph break, and print exactly what eager prints
    if without == "the kernel's op":
        from overflow_fast.stats import ops

        monkeypatch.setattr(ops, "HAVE_CPU_OPS", False)
        options = {}
    else:
        options = {"backend": "torch"}
    batches = mlp_batches(2)
    batches[3][0, 0] = float("nan")
    eager = mlp()
    DebugUnderflowOverflow(eager, check="batch", max_frames_to_save=6, **options)
    want = run(eager, batches)
    explained = mlp()
    DebugUnderflowOverflow(explained, check="batch", **options)
    explained = dynamo.explain(explained)(mlp_batches(None)[0])
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    dynamo.reset()
    model = mlp()
    DebugUnderflowOverflow(model, check="batch", max_frames_to_save=6, **options)
    got = run(torch.compile(model, backend=compiler), batches)
    assert got == want and "has infs" in got[0]


@whole_graphs
def test_no_recompile_from_batch_to_batch():
    model = mlp()
    detector = attach(model, "batch")
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    run(compiled, mlp_batches(None) * 2)
    assert counters["stats"]["unique_graphs"] == 1
    assert detector.batch_number == 8


def test_compiled_submodules_keep_the_order_of_frames():
    # only some modules compiled: their records must come back between the eager frames around them
    want = eager_report("batch", mlp_batches(2))
    model = mlp()
    attach(model, "batch")
    model[2].compile(backend="aot_eager")
    model[5].compile(backend="aot_eager")
    got = run(model, mlp_batches(2))
    assert got == want


def test_compiled_training_step_reports_the_forward_as_eager():
    want = eager_report("batch", mlp_batches(2), train=True)
    model = mlp()
    attach(model, "batch")
    got = run(torch.compile(model, backend="aot_eager"), mlp_batches(2), train=True)
    assert got == want and "has infs" in got[0]


def unique_graphs(model, batches):
    """Graphs that torch.compile makes of ``model`` over ``batches``, and what the run printed."""
    counters.clear()
    dynamo.reset()
    printed = run(torch.compile(model, backend="aot_eager"), batches)
    return counters["stats"]["unique_graphs"], printed


@pytest.mark.parametrize("variant", ["batch", "watch"])
def test_hooks_outside_a_traced_frame_run_eagerly(variant):
    # a graph break in a module's forward loses the frame around it: the modules called there run
    # their hooks from code that dynamo skips; the detector adds no graph of its own, and prints
    # what eager prints
    make = lambda: mlp(MLP, GraphBreak())  # noqa: E731
    plain = make()  # hooks that do nothing: the graphs torch makes of a model with hooks
    for module in plain.modules():
        module.register_forward_pre_hook(lambda *args: None)
        module.register_forward_hook(lambda *args: None, always_call=True)
    without, _ = unique_graphs(plain, mlp_batches(None))
    model = make()
    attach(model, variant)
    graphs, got = unique_graphs(model, mlp_batches(2) * 2)
    assert graphs <= without
    assert got == eager_report(variant, mlp_batches(2) * 2, make=make) and "has infs" in got[0]


def test_a_builtin_sequential_root():
    # nn.Sequential's forward is torch's own: the root's hook (kept out of the graph) loses the frame
    # around it, and torch 2.11 then runs the whole model eagerly where torch 2.13 compiles its forward
    # alone; either way no recompile from call to call, and eager's report
    make = lambda: mlp(nn.Sequential)  # noqa: E731
    model = make()
    attach(model, "batch")
    graphs, got = unique_graphs(model, mlp_batches(2) * 2)
    assert graphs <= 1
    assert got == eager_report("batch", mlp_batches(2) * 2, make=make) and "has infs" in got[0]


@whole_graphs
def test_a_backend_named_that_cannot_run_is_not_replaced_under_compile(monkeypatch):
    # backend="cpu" without the kernel: compiled, the read says so as the eager one does, rather
    # than taking the torch backend's rows in its place
    from overflow_fast.stats import cpu_backend, dispatch, ops

    monkeypatch.setattr(ops, "HAVE_CPU_OPS", False)
    monkeypatch.setattr(cpu_backend, "unavailable_reason", lambda: "no kernel in this test")
    monkeypatch.setattr(dispatch, "_loaded", {})
    monkeypatch.setattr(dispatch, "_choices", {})

    def read(x):
        return dispatch.tensor_stats([x], backend="cpu").values

    with pytest.raises(RuntimeError, match="backend='cpu' is unavailable"):
        read(torch.ones(3))
    with pytest.raises(Exception, match="backend='cpu' is unavailable"):
        torch.compile(read, backend="aot_eager")(torch.ones(3))
