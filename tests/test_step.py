"""check="step": no hook below the root while the run is healthy; at the first nan/inf the step is
replayed with watch()'s detector, whose report it prints (the same lines as watch() for that step),
then a Replay: line. Each case against watch() on the same run, or against ground truth built by
construction."""

import contextlib
import gc
import io
import json
import weakref

import pytest
import torch
import torch.nn.modules.module as torch_module
from torch import nn

import models
from overflow_fast import OverflowDetected, watch

INF = float("inf")
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks", "_global_forward_hooks_always_called")


class InfGradient(torch.autograd.Function):
    """The identity forward; its backward multiplies the gradient by inf (born in backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * INF


class Poisoned(nn.Module):
    """Wraps a module; once ``armed`` (a number of calls to wait), its output is poisoned: in the
    forward (an inf written into it) or in the backward (``InfGradient``). ``once``: only the call
    that fires (a transient fault: a replay calls it again and sees it finite)."""

    def __init__(self, inner, where="forward", once=False):
        super().__init__()
        self.inner, self.where, self.once = inner, where, once
        self.armed = None

    def forward(self, x):
        y = self.inner(x)
        if self.armed is not None:
            if self.armed > 0:
                self.armed -= 1
            else:
                if self.once:
                    self.armed = None
                if self.where == "forward":
                    y = y.clone()
                    y[0, 0] = INF
                else:
                    y = InfGradient.apply(y)
        return y


def gpt2(where, once=False):
    model = models.gpt2(n_layer=2).train()
    block = model.transformer.h[1].mlp
    block.act = Poisoned(block.act, where, once)
    return model, block.act


def train(model, steps, poisoned, bad_at, optimizer=None, ids=None, **kwargs):
    """``steps`` training steps of a GPT-2, ``poisoned`` firing at step ``bad_at``: (stdout, the
    error or None, the step it stopped at)."""
    ids = models.token_batch(0) if ids is None else ids
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    out = io.StringIO()
    torch.manual_seed(7)  # dropout draws the same masks in every run
    with contextlib.redirect_stdout(out):
        for step in range(steps):
            if step == bad_at:
                poisoned.armed = 0
            try:
                model(input_ids=ids, labels=ids, **kwargs).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            except ValueError as error:
                return out.getvalue(), error, step
    return out.getvalue(), None, None


def report_lines(text):
    return [line for line in text.splitlines() if not line.startswith("Replay:")]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_replay_prints_watchs_report_of_that_step(where):
    model, poisoned = gpt2(where)
    watch(model, max_frames_to_save=8)
    want, want_error, want_step = train(model, 4, poisoned, 2)
    model, poisoned = gpt2(where)
    detector = watch(model, check="step", max_frames_to_save=8)
    got, error, step = train(model, 4, poisoned, 2)
    assert (step, want_step) == (2, 2)
    assert report_lines(got) == report_lines(want), got
    assert got.splitlines()[-1] == "Replay: reproduced"
    assert isinstance(error, OverflowDetected) and str(error) == str(want_error)
    detection = error.detection
    assert detection["check"] == "step" and detection["transient"] is False
    assert detection["replay"] == {"outcome": "reproduced", "transient": False, "why": None}
    assert (detection["module"], detection["phase"]) == (want_error.detection["module"], where)
    assert detector.detections[-1] is detection or detector.detections[-1] == detection


def test_no_hook_below_the_root_while_healthy():
    model, _ = gpt2("forward")
    before = {name: len(getattr(torch_module, name)) for name in GLOBAL_HOOKS}
    detector = watch(model, check="step")
    for name, module in model.named_modules():
        hooks = sum(len(getattr(module, attribute)) for attribute in MODULE_HOOKS)
        assert hooks == (2 if name == "" else 0), (name, hooks)
    assert {name: len(getattr(torch_module, name)) for name in GLOBAL_HOOKS} == before
    seen = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append(p)) for p in model.parameters()]
    ids = models.token_batch(0)
    model(input_ids=ids, labels=ids).loss.backward()  # a healthy step hooks nothing more
    for name, module in model.named_modules():
        assert sum(len(getattr(module, attribute)) for attribute in MODULE_HOOKS) == (2 if name == "" else 0)
    for handle in handles:
        handle.remove()
    detector.remove()
    assert all(sum(len(getattr(m, a)) for a in MODULE_HOOKS) == 0 for m in model.modules())


def test_a_transient_fault_is_said_to_be_one():
    model, poisoned = gpt2("forward", once=True)
    watch(model, check="step")
    out, error, step = train(model, 3, poisoned, 1)
    assert step == 1 and isinstance(error, OverflowDetected)
    assert out.splitlines()[-1] == ("Replay: not reproduced: a transient fault (hardware, a race, memory "
                                    "corruption) is likely"), out
    assert error.detection["transient"] is True and error.detection["replay"]["outcome"] == "not reproduced"
    assert "output[logits] has nans" in out.splitlines()  # what the guard itself saw


class Doubling(nn.Module):
    """Its first op keeps nothing of its input for the backward: the input may change in place
    between the forward and the backward."""

    def __init__(self):
        super().__init__()
        self.body = Poisoned(nn.Linear(4, 4), "backward")

    def forward(self, x):
        return self.body(x * 2)


def test_inputs_changed_in_place_are_never_replayed():
    model = Doubling()
    watch(model, check="step")
    x = torch.ones(2, 4)
    model.body.armed = 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(OverflowDetected) as raised:
        loss = model(x).sum()
        x.add_(1)  # the batch changes in place between the forward and its backward
        loss.backward()
    assert out.getvalue().splitlines()[-1] == ("Replay: not replayed: the step's inputs changed in place after its "
                                               "forward")
    assert raised.value.detection["transient"] is None


def test_gradient_accumulation_replays_the_micro_batch_that_went_bad():
    model, poisoned = gpt2("backward")
    watch(model, check="step", max_frames_to_save=4)
    ids = models.token_batch(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(OverflowDetected) as raised:
        for micro in range(4):
            if micro == 2:
                poisoned.armed = 0
            model(input_ids=ids, labels=ids).loss.backward()  # accumulated, no optimizer step between
    assert raised.value.batch_number == 2 and raised.value.phase == "backward"
    assert "Detected inf/nan during the backward of batch_number=2" in out.getvalue()
    assert out.getvalue().splitlines()[-1] == "Replay: reproduced"


@pytest.mark.parametrize("on_detect", ["warn", "record", "skip"])
def test_strategies_that_go_on(on_detect):
    model, poisoned = gpt2("backward", once=True)
    detector = watch(model, check="step", on_detect=on_detect)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = models.token_batch(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings_caught() as caught:
        poisoned.armed = 0
        model(input_ids=ids, labels=ids).loss.backward()
        if on_detect != "skip":
            optimizer.zero_grad()  # what a loop that goes on does with such gradients (skip does it itself)
        optimizer.step()
        optimizer.zero_grad()
        changed = {name for name, p in model.named_parameters() if not torch.equal(p, weights[name])}
        model(input_ids=ids, labels=ids).loss.backward()  # training goes on, checked afresh
        optimizer.step()
    assert len(detector.detections) == 1 and detector.detections[0]["check"] == "step"
    if on_detect == "record":
        assert out.getvalue() == "" and not caught
    else:
        assert "Replay: not reproduced" in out.getvalue()
    if on_detect == "warn":
        assert any("training goes on" in str(w.message) for w in caught)
    assert not changed  # no update from that step
    if on_detect == "skip":
        assert "skipping this step" in out.getvalue()


@contextlib.contextmanager
def warnings_caught():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_an_evaluation_forward_is_checked_and_replayed():
    model, poisoned = gpt2("forward")
    model.eval()
    watch(model, check="step", max_frames_to_save=3)
    ids = models.token_batch(0)
    poisoned.armed = 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.no_grad(), pytest.raises(OverflowDetected) as raised:
        model(input_ids=ids)
    assert raised.value.phase == "forward" and out.getvalue().splitlines()[-1] == "Replay: reproduced"
    assert "Source: born in forward of transformer.h.1.mlp.act (Poisoned)" in out.getvalue()


def test_a_backward_through_two_outputs_counts_the_gradient_from_outside_once():
    """The loss is made of the logits inside the model: the gradient kept at the logits holds the
    loss's path too; the replay's gradient frames are watch()'s, not doubled."""
    model, poisoned = gpt2("backward")
    watch(model, max_frames_to_save=12)
    want, _, _ = train(model, 2, poisoned, 1)
    model, poisoned = gpt2("backward")
    watch(model, check="step", max_frames_to_save=12)
    got, _, _ = train(model, 2, poisoned, 1)
    assert report_lines(got) == report_lines(want)


def test_the_replay_leaves_the_run_as_it_was():
    """Weights, gradients, buffers, the RNG and a private generator are those a run without the
    detector has after the same steps, with a detection (recorded) replayed in the middle."""
    def run(attach):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5),
                              Poisoned(nn.Linear(6, 6), "backward", once=True))
        generator = torch.Generator().manual_seed(3)
        if attach:
            watch(model, check="step", on_detect="record")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model[3].armed = 0 if step == 1 else None
            x = torch.randn(4, 6, generator=generator)
            with contextlib.redirect_stdout(io.StringIO()):
                model(x).sum().backward()
            if step == 1:
                optimizer.zero_grad()  # the bad step's gradients are dropped
            optimizer.step()
            if step < 2:
                optimizer.zero_grad()
        return model, torch.get_rng_state(), generator.get_state(), torch.rand(1)

    plain, with_guard = run(False), run(True)
    for a, b in zip(plain[0].state_dict().values(), with_guard[0].state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(plain[0].parameters(), with_guard[0].parameters()):
        assert torch.equal(a.grad, b.grad)
    assert torch.equal(plain[1], with_guard[1]) and torch.equal(plain[2], with_guard[2])
    assert torch.equal(plain[3], with_guard[3])


def test_a_removed_guard_frees_the_model():
    model, poisoned = gpt2("forward")
    detector = watch(model, check="step", on_detect="record")
    ids = models.token_batch(0)
    poisoned.armed = 0
    with contextlib.redirect_stdout(io.StringIO()):
        output = model(input_ids=ids, labels=ids)
    detector.remove()
    alive = weakref.ref(model)
    del model, poisoned, detector
    gc.collect()
    assert alive() is None
    output.loss.backward()  # a removed guard's hook on a live output does nothing


def test_records_say_which_mode_wrote_them(tmp_path):
    model, poisoned = gpt2("forward")
    log = tmp_path / "run.jsonl"
    detector = watch(model, check="step", log=str(log), on_detect="record", frames_every=2)
    with contextlib.redirect_stdout(io.StringIO()):
        train(model, 4, poisoned, 3)
    detector.remove()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = sorted({r["step"] for r in records if r["record"] == "entry"})
    assert steps == [0, 2]  # the frames steps only
    detections = [r for r in records if r["record"] == "detection"]
    assert detections[0]["check"] == "step" and detections[0]["step"] == 3 and detections[0]["phase"] == "forward"
    assert detections[0]["replay"]["outcome"] == "reproduced"


def test_a_frames_step_is_watchs_and_the_others_are_guarded():
    model, poisoned = gpt2("forward")
    watch(model, check="step", frames_every=2, max_frames_to_save=8)
    out, error, step = train(model, 4, poisoned, 2)  # step 2 is a frames step: watch() finds it itself
    assert step == 2 and error.detection["check"] == "step" and "replay" not in error.detection
    assert "Source: born in forward of transformer.h.1.mlp.act (Poisoned)" in out
    assert all(sum(len(getattr(m, a)) for a in MODULE_HOOKS) == (2 if m is model else 0) for m in model.modules())


def test_frames_every_needs_check_step():
    with pytest.raises(ValueError, match="frames_every"):
        watch(nn.Linear(2, 2), frames_every=10)


def test_under_a_grad_scaler_a_backoff_is_the_scalers_and_a_persistent_nan_is_replayed():
    model, poisoned = gpt2("backward")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1000)
    watch(model, check="step", min_loss_scale=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = models.token_batch(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(OverflowDetected) as raised:
        for step in range(6):
            poisoned.armed = 0  # every step: the scale halves each time, to min_loss_scale
            scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    lines = out.getvalue().splitlines()
    backoffs = [line for line in lines if line.startswith("GradScaler backoff")]
    assert len(backoffs) == 2, lines  # at 4.0 and 2.0; at 1.0 (min_loss_scale) it is a detection
    assert raised.value.detection["scaler"]["why"].startswith("the scale is 1.0e+00")
    assert any(line.startswith("GradScaler: the scale is") for line in lines)
    assert lines[-1] == "Replay: reproduced"


def test_compiled_healthy_steps_add_no_graph_break_and_the_replay_runs_eagerly():
    dynamo = pytest.importorskip("torch._dynamo")
    from overflow_fast import _compat

    if not _compat.COMPILES_A_WATCHED_MODEL_WHOLE:
        pytest.skip("this torch compiles a model with a detector eagerly or in pieces")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), Poisoned(nn.Linear(8, 8)), nn.ReLU())
    watch(model, check="step")
    dynamo.reset()
    explained = dynamo.explain(model)(torch.randn(2, 8))
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8)
    compiled(x).sum().backward()
    model[2].armed = 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(OverflowDetected):
        compiled(x).sum().backward()
    dynamo.reset()
    assert "Source: born in forward of 2 (Poisoned)" in out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("Replay:")


def test_a_hook_the_replay_leaves_out_leaves_a_transient_fault_untold():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    watch(model, check="step")
    handle = model[0].weight.register_hook(lambda grad: grad * INF)  # someone else's code, every step
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(OverflowDetected) as raised:
        model(torch.ones(2, 4)).sum().backward()
    handle.remove()
    assert out.getvalue().splitlines()[-1] == ("Replay: not reproduced: hooks of other code ran in the step (1 on "
                                               "parameters), and a replay leaves them out: a transient fault cannot "
                                               "be told")
    assert raised.value.detection["transient"] is None


def test_a_copied_model_carries_its_guard():
    import copy

    model, poisoned = gpt2("forward")
    watch(model, check="step", max_frames_to_save=3)
    copied = copy.deepcopy(model)
    copied.transformer.h[1].mlp.act.armed = 0
    ids = models.token_batch(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(OverflowDetected):
        copied(input_ids=ids, labels=ids)
    assert out.getvalue().splitlines()[-1] == "Replay: reproduced"


def _ddp_worker(rank, wheres):
    for where in wheres:  # one process group for both cases: each spawn of the ranks costs seconds
        _ddp_case(rank, where)


def _ddp_case(rank, where):
    from torch.nn.parallel import DistributedDataParallel

    from overflow_fast import OverflowDetected

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), Poisoned(nn.Linear(4, 4), where), nn.LayerNorm(4))
    ddp = DistributedDataParallel(model)
    detector = watch(ddp, check="step")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = io.StringIO()
    stopped = None
    with contextlib.redirect_stdout(out):
        for step in range(4):
            if step == 2 and rank == 1:
                model[2].armed = 0
            try:
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
                ddp(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            except OverflowDetected as error:
                stopped = (step, error)
                break
    # every rank stops at step 2, naming the rank that made it, before any update from it
    assert stopped is not None and stopped[0] == 2, out.getvalue()
    error = stopped[1]
    lines = out.getvalue().splitlines()
    if where == "forward":
        assert error.ranks == [1]
        if rank == 1:
            assert lines[-1] == "[rank 1/2] Replay: reproduced on rank 1", lines
            assert "[rank 1/2] Source: born in forward of module.2 (Poisoned): output from finite inputs and " \
                   "weights" in lines
    else:  # DDP averages the gradients: every rank sees the nan, the replays tell where it was made
        assert error.ranks == [0, 1]
        want = "Replay: reproduced on rank 1" if rank == 1 else "Replay: not reproduced on this rank; reproduced on rank 1"
        assert lines[-1] == f"[rank {rank}/2] {want}", lines
        assert error.detection["transient"] is False
    assert all(torch.isfinite(p).all() for p in model.parameters())
    detector.remove()


@pytest.mark.one_path  # the ranks' agreement; the guard's reads on each path: the tests above
def test_ddp_every_rank_stops_and_the_report_names_the_rank_that_reproduced_it():
    """A nan made on rank 1 in its forward, then one made in its backward (DDP averages the
    gradients, so every rank sees that one)."""
    from test_distributed import run_ranks

    run_ranks(_ddp_worker, ("forward", "backward"))


def test_a_forward_run_by_a_backward_hook_is_guarded_as_a_pass_of_its_own():
    from test_reentrant_passes import Probe

    probe = Probe(bad_step=2)
    detector = watch(probe.probe, check="step", max_frames_to_save=3)
    out = io.StringIO()
    stopped = None
    with contextlib.redirect_stdout(out):
        for step in range(3):
            try:
                probe(step)
            except OverflowDetected as error:
                stopped = (step, error)
                break
    assert stopped is not None and stopped[0] == 2 and stopped[1].batch_number == 2, out.getvalue()
    assert "Source: came in from outside, in the input batch: (model) (GPT2LMHeadModel) input[inputs_embeds]" \
        in out.getvalue().splitlines()
    assert out.getvalue().splitlines()[-1] == "Replay: reproduced"
    detector.remove()
