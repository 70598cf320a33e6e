"""watch() and the options behind it: gradient frames (backward=True), on_detect, ignore,
warn_above, and the source line, each against ground truth built by construction; then real
transformers models trained in fp16 under watch()."""

import contextlib
import io
import os
import warnings

import pytest
import torch
from torch import nn

import models
import overflow_fast.stats.kinds
from compat import capture
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch

CHECKS = ("module", "batch")
INF = float("inf")


def two_layers():
    """fp16: finite forward and finite gradients everywhere except ``0``'s weight gradient.

    x = 300 everywhere and tiny first-layer weights keep activations small; the second layer's
    weights of 10 make the gradient arriving at layer 0 about 40 per element, and layer 0's weight
    gradient sums 8 rows of 40 * 300 = 96000 > 65504: inf, born in layer 0's backward."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(1e-3)
        model[0].bias.zero_()
        model[1].weight.fill_(10.0)
        model[1].bias.zero_()
    return model.half()


def train_step(model, x, optimizer):
    optimizer.zero_grad()
    model(x).float().sum().backward()
    optimizer.step()


@pytest.mark.parametrize("check", CHECKS)
def test_gradient_overflow_raises_inside_backward_and_names_its_source(check):
    model = two_layers()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch(model, check=check)
    x = torch.full((8, 4), 300.0, dtype=torch.float16)
    out, error = capture(lambda: train_step(model, x, optimizer))
    assert isinstance(error, OverflowDetected) and str(error).startswith("DebugUnderflowOverflow: inf/nan")
    # raised inside backward(): the optimizer never stepped
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    lines = out.splitlines()
    assert lines[0] == "weight.grad has infs"
    assert "Detected inf/nan during the backward of batch_number=0" in lines
    assert "                  0 Linear\n     inf      inf weight.grad" in out
    assert lines[-2] == "Source: born in backward of 0 (Linear): weight.grad from a finite incoming gradient"
    # find_op replays that call's backward: the matmul that summed the 8 rows of 40 * 300, in the
    # Linear's own (torch's) code, never "at" the line that called the model
    assert lines[-1] == ("Op: AddmmBackward0 in 0 (Linear), torch's own code: inf from finite inputs "
                         "(input abs max 3.0e+02); reproduced on the same inputs")
    assert lines[-3] == "Where: rows 0, 1, 2, 3 of 4; first at [0, 0]; 16 of 16 elements are inf"
    op, where = error.detection.pop("op"), error.detection.pop("where")
    assert error.detection.pop("transient") is False
    assert error.detection == {"batch_number": 0, "phase": "backward", "module": "0", "class": "Linear",
                               "entries": ["weight.grad"]}
    assert where == {"entry": "weight.grad", "shape": [4, 4], "rows": [0, 1, 2, 3], "rows_total": 4, "batch": False,
                     "first": [0, 0], "token": None, "samples": None, "nan": 0, "posinf": 16, "neginf": 0,
                     "numel": 16}
    assert op == {"op": "AddmmBackward0", "file": None, "line": None, "phase": "backward",
                  "what": "inf from finite inputs (input abs max 3.0e+02)", "module": "0 (Linear)",
                  "reproduced": "on the same inputs"}


@pytest.mark.parametrize("check", CHECKS)
def test_the_drop_in_does_not_see_gradients(check):
    model = two_layers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    DebugUnderflowOverflow(model, check=check)
    x = torch.full((8, 4), 300.0, dtype=torch.float16)
    out, error = capture(lambda: train_step(model, x, optimizer))
    assert error is None and out == ""  # as the reference: the step applied the inf


class DivideByZeroInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad / 0.0


class Culprit(nn.Module):
    def forward(self, x):
        return DivideByZeroInBackward.apply(x)


CULPRIT_LINE = Culprit.forward.__code__.co_firstlineno + 1


@pytest.mark.parametrize("check", CHECKS)
def test_a_module_that_breaks_only_in_backward_is_named(check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Culprit(), nn.Linear(3, 1))
    watch(model, check=check)
    out, error = capture(lambda: model(torch.randn(2, 3)).sum().backward())
    assert isinstance(error, OverflowDetected)
    # the forward is finite; the first non-finite gradient arrives at layer 0's output, and the
    # module whose backward made it is the one that consumed that output
    assert out.splitlines()[-2] == ("Source: born in backward, in the gradient arriving at 0 (Linear) "
                                    "output.grad: made by the backward of 1")
    assert out.splitlines()[-1] == (f"Op: DivideByZeroInBackwardBackward at {__file__}:{CULPRIT_LINE}: "
                                    "inf from finite inputs (input abs max 5.5e-01); reproduced on the same inputs")
    assert "Detected inf/nan during the backward of batch_number=0" in out


class Amplify(nn.Module):
    def forward(self, x):
        return (x.abs() + 1) * 1e5  # overflows fp16 from any finite input (at least 1e5); no weights


AMPLIFY_LINE = Amplify.forward.__code__.co_firstlineno + 1


@pytest.mark.parametrize("check", CHECKS)
def test_forward_source_is_the_module_that_produced_the_inf(check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Amplify()), nn.Linear(4, 2)).half()
    watch(model, check=check)
    out, error = capture(lambda: model(torch.full((2, 4), 3.0, dtype=torch.float16)))
    assert isinstance(error, OverflowDetected)
    assert out.splitlines()[-2] == "Source: born in forward of 1.1 (Amplify): output from finite inputs and weights"
    assert out.splitlines()[-1] == (f"Op: aten.mul at {__file__}:{AMPLIFY_LINE}: inf from finite inputs "
                                    "(input abs max 1.0e+05); reproduced on the same inputs")


@pytest.mark.parametrize("check", CHECKS)
def test_a_bad_weight_and_a_bad_batch_are_named_as_coming_from_outside(check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    watch(model, check=check)
    with torch.no_grad():
        model[1].weight[0, 0] = INF
    out, error = capture(lambda: model(torch.ones(1, 4)))
    assert out.splitlines()[-1] == "Source: a weight already non-finite before this forward: 1 (Linear) weight"
    model = nn.Sequential(nn.Linear(4, 4))
    watch(model, check=check)
    x = torch.ones(1, 4)
    x[0, 1] = float("nan")
    out, error = capture(lambda: model(x))
    assert error is not None
    assert out.splitlines()[-1] == "Source: came in from outside, in the input batch: (model) (Sequential) input[0]"
    # made in the model's own code, before a module: not the batch
    model = ScaledFirst()
    watch(model, check=check)
    out, error = capture(lambda: model(torch.ones(1, 4)))
    assert out.splitlines()[-2].startswith("Source: born outside any module, in the code before fc (Linear) input[0]")


class ScaledFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x * float("inf"))


class Masked(nn.Module):
    """Fills an attention-style mask with -inf on purpose, then uses it safely."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        mask = torch.zeros(4, 4).masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
        return self.scores(self.proj(x), mask=mask)

    def scores(self, h, mask):
        return torch.softmax(h @ h.T / 2 + mask[: h.shape[0], : h.shape[0]], dim=-1)


class MaskedScores(nn.Module):
    def forward(self, h, attention_mask):
        return torch.softmax(h @ h.T + attention_mask, dim=-1)


class WithMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MaskedScores()

    def forward(self, x):
        mask = torch.zeros(x.shape[0], x.shape[0]).masked_fill(torch.ones(x.shape[0], x.shape[0]).triu(1).bool(),
                                                               float("-inf"))
        return self.attn(x, attention_mask=mask)


@pytest.mark.parametrize("check", CHECKS)
def test_ignore_keeps_a_mask_of_minus_inf_in_the_frame_but_out_of_detection(check):
    x = torch.randn(3, 4)
    out, error = capture(lambda: (watch(model := WithMask(), check=check), model(x)))
    assert isinstance(error, OverflowDetected) and out.startswith("input[attention_mask] has infs")
    model = WithMask()
    watch(model, check=check, ignore=["attn:input[attention_mask]"], trace_batch_nums=[0])
    out, error = capture(lambda: model(x))
    assert error is None
    assert "     0.00e+00      inf input[attention_mask]".strip() in out  # still shown
    assert "has infs" not in out
    # a module pattern alone ignores every entry of the modules it matches
    model = WithMask()
    watch(model, check=check, ignore="att?")
    out, error = capture(lambda: model(x))
    assert error is None and out == ""


def test_ignore_patterns_treat_brackets_literally():
    from overflow_fast.hooks.counting import Counting
    from overflow_fast.hooks.options import Options
    counting = Counting("every", None, Options.of(ignore=["*.attn:input[attention_mask]", "decoder.*"]).ignore)
    assert counting.ignored("h.0.attn", "input[attention_mask]")
    assert not counting.ignored("h.0.attn", "input[a]")
    assert counting.ignored("decoder.block.0", "output")
    assert not counting.ignored("encoder", "output")
    with pytest.raises(ValueError):
        Options.of(on_detect="shout")
    with pytest.raises(ValueError):
        Options.of(warn_above=2.0)
    with pytest.raises(TypeError):
        Options.of(ignore=[3])


@pytest.mark.parametrize("check", CHECKS)
def test_on_detect_warn_reports_each_offender_once_and_training_goes_on(check):
    model = nn.Sequential(nn.Linear(2, 2), Amplify()).half()
    detector = DebugUnderflowOverflow(model, check=check, on_detect="warn")
    x = torch.full((1, 2), 3.0, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, error = capture(lambda: [model(x) for _ in range(3)])
    assert error is None
    assert out.count("output has infs") == 1 and out.count("Detected inf/nan during batch_number=0") == 1
    assert len([w for w in caught if "on_detect='warn'" in str(w.message)]) == 1
    assert [d["batch_number"] for d in detector.detections] == [0, 1, 2]
    assert detector.batch_number == 3


@pytest.mark.parametrize("check", CHECKS)
def test_on_detect_record_only_records(check):
    model = nn.Sequential(nn.Linear(2, 2), Amplify()).half()
    detector = DebugUnderflowOverflow(model, check=check, on_detect="record")
    out, error = capture(lambda: [model(torch.full((1, 2), 3.0, dtype=torch.float16)) for _ in range(2)])
    assert error is None and out == ""
    where = detector.detections[0].pop("where")
    assert detector.detections[0] == {"batch_number": 0, "phase": "forward", "module": "1", "class": "Amplify",
                                      "entries": ["output"]}
    assert len(detector.detections) == 2
    if check == "module":  # decided in its hook: the output is at hand
        assert (where["rows"], where["first"], where["posinf"], where["numel"]) == ([0], [0, 0], 2, 2)
    else:  # decided when the forward ended: without find_op, the output was not kept
        assert where == {"entry": "output", "why": "the call's tensors are not kept: find_op=True keeps them "
                                                   "until the pass is decided"}


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


@pytest.mark.parametrize("check", CHECKS)
def test_warn_above_warns_once_before_the_overflow(check):
    model = nn.Sequential(Scale(1.0), Scale(1.0))
    DebugUnderflowOverflow(model, check=check, warn_above=0.5)
    out, error = capture(lambda: [model(torch.tensor([v], dtype=torch.float16)) for v in (1000.0, 40000.0, 50000.0)])
    assert error is None
    lines = [line for line in out.splitlines() if "of the largest float16" in line]
    # once, at the batch where it first crossed half of 65504, where it first appears: the entries
    # after it hold copies of the same value (each (module, entry) is warned of once, too)
    assert lines == [
        "0 Scale input[0]: abs max 4.00e+04 is 61% of the largest float16 (6.55e+04) at batch_number=1",
    ]


@pytest.mark.parametrize("check", CHECKS)
def test_warn_above_names_a_new_value_and_the_trainers_step(check):
    model = nn.Sequential(Scale(1.0), Scale(1.5))
    detector = DebugUnderflowOverflow(model, check=check, warn_above=0.5)
    detector.set_step(33, "train")
    out, error = capture(lambda: model(torch.tensor([30000.0], dtype=torch.float16)))
    assert error is None
    lines = [line for line in out.splitlines() if "of the largest float16" in line]
    assert lines == [  # 30000 is 46%, below; 45000, born in 1, is a value of its own
        "1 Scale output: abs max 4.50e+04 is 69% of the largest float16 (6.55e+04) at optimizer step 33",
    ]


@pytest.mark.parametrize("check", CHECKS)
def test_under_autocast_headroom_is_judged_in_the_dtype_a_call_computes_in(check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InFloat32())
    with torch.no_grad():
        model[0].weight[0, 0] = 4.0e4  # a float32 weight: 61% of float16's largest, which autocast casts it to
        model[1].weight.fill_(4.0e4)  # a call that computes in float32 under autocast: no warning
    watch(model, check=check, warn_above=0.5)
    out, error = capture(lambda: run_autocast(model))
    assert error is None
    lines = [line for line in out.splitlines() if "of the largest" in line]
    assert lines == ["0 Linear weight: abs max 4.00e+04 is 61% of the largest float16 it is cast to under autocast "
                     "(6.55e+04) at batch_number=0"], out


class InFloat32(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x.float() * self.weight


def run_autocast(model):
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(2, 4) * 1e-3)


@pytest.mark.parametrize("check", CHECKS)
def test_warn_above_reports_underflow(check):
    model = nn.Sequential(Scale(1e-6))
    with torch.no_grad():
        weight = nn.Parameter(torch.full((4,), 1e-6, dtype=torch.float16))  # fp16 subnormals
    model[0].register_parameter("weight", weight)
    model[0].register_parameter("bias", nn.Parameter(torch.zeros(4, dtype=torch.float16)))  # zeros by design
    DebugUnderflowOverflow(model, check=check, warn_above=0.9)
    out, error = capture(lambda: model(torch.full((4,), 1e-3, dtype=torch.float16)))
    assert error is None
    # one line for the module: its weight is subnormal, its output underflowed to zeros (1e-9 in
    # fp16); its bias is zeros by design
    assert out.splitlines() == ["0 Scale underflows at batch_number=0: weight: 100% of 4 elements are subnormal; "
                                "output: all 4 elements are zero",
                                "(model) Sequential underflows at batch_number=0: output: all 4 elements are zero"]


@pytest.mark.parametrize("check", CHECKS)
def test_warn_above_underflow_lines_once_per_module_per_100_steps_gradients_when_asked(check):
    # fp16 without loss scaling: the gradients underflow at every step
    def run(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), Scale(1e-4)).half()
        detector = DebugUnderflowOverflow(model, check=check, warn_above=0.5, backward=True, **options)
        outs = []
        for step in range(250):
            if step in (0, 99, 100, 200):
                detector.set_step(step)
            x = torch.full((2, 4), 1e-3, dtype=torch.float16)
            out, error = capture(lambda: model(x).sum().backward())
            assert error is None
            outs.append(out)
        return outs

    outs = run()
    assert [i for i, out in enumerate(outs) if out] == [0, 100, 200]  # set_step: 100 steps apart
    assert all(".grad" not in out for out in outs)
    asked = run(warn_gradients=True)
    assert any(".grad" in out for out in asked)


@pytest.mark.parametrize("check", CHECKS)
def test_batch_mode_reads_the_host_once_per_forward_and_once_per_backward(check, monkeypatch):
    # host reads counted on torch.Tensor.cpu, the detector's one way to the host (a
    # TorchFunctionMode does not see what hooks do inside backward); on an accelerator's path:
    # CPU rows are written in host memory already
    monkeypatch.setattr(overflow_fast.stats.kinds, "CPU_AS_DEVICE", True)
    reads = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(1) or real_cpu(self, *a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    watch(model, check=check)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(2, 4) for _ in range(3)]
    for x in batches:
        train_step(model, x, optimizer)
    if check == "batch":
        assert len(reads) == 6
    else:  # one read per call with a tensor not read before in its pass: 3 forward hooks (the
        # Sequential's input and output were its children's), 4 parameters, 3 output gradients
        assert len(reads) == 3 * (3 + 4 + 3)


def test_watch_defaults_and_overrides():
    model = nn.Linear(2, 2)
    detector = watch(model)
    assert (detector.check, detector.kwargs, detector.containers, detector.backward) == ("batch", True, True, True)
    detector.remove()
    with watch(model, check="module", backward=False) as detector:
        assert (detector.check, detector.backward) == ("module", False)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


# -- real models ------------------------------------------------------------------------------

def fp16_steps(model, batches, loss_of, check, steps_before_overflow, poison):
    """Train ``model`` in fp16 under watch(); after ``steps_before_overflow`` clean steps,
    ``poison(model)`` plants an overflow. Returns (stdout, errors per step)."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch(model, check=check)
    out = io.StringIO()
    errors = []
    with contextlib.redirect_stdout(out):
        for step, batch in enumerate(batches):
            if step == steps_before_overflow:
                poison(model)
            try:
                optimizer.zero_grad()
                loss_of(model, batch).backward()
                optimizer.step()
                errors.append(None)
            except ValueError as error:
                errors.append(error)
                break
    return out.getvalue(), errors


def scale_weight(parameter, largest):
    """Scale a weight so that its largest magnitude is ``largest``: still finite in fp16, but its
    layer's outputs (sums of many such products) overflow."""
    def poison(model):
        with torch.no_grad():
            weight = parameter(model)
            weight.mul_(largest / weight.abs().max().float())
    return poison


def t5_for_training():
    model = models.t5(torch.float16).train()
    model.config.decoder_start_token_id = 0  # labels= builds decoder inputs from it
    return model


REAL = {
    "gpt2": (lambda: models.gpt2(torch.float16).train(), lambda m, b: m(input_ids=b, labels=b).loss.float(),
             lambda m: m.transformer.h[1].mlp.c_fc.weight, "transformer.h.1.mlp.c_fc"),
    "llama": (lambda: models.llama(torch.float16).train(), lambda m, b: m(input_ids=b, labels=b).loss.float(),
              lambda m: m.model.layers[0].mlp.up_proj.weight, "model.layers.0.mlp.up_proj"),
    "t5": (lambda: t5_for_training(),
           lambda m, b: m(input_ids=b, labels=b).loss.float(),
           lambda m: m.encoder.block[1].layer[1].DenseReluDense.wi_0.weight,
           "encoder.block.1.layer.1.DenseReluDense.wi_0"),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_models_train_in_fp16_under_watch(name, check):
    build, loss_of, parameter, culprit = REAL[name]
    batches = [models.token_batch(seed) for seed in range(4)]
    out, errors = fp16_steps(build(), batches, loss_of, check, 2, scale_weight(parameter, 30000.0))
    # two clean steps, then the scaled weight overflows its layer's output in the third forward
    assert errors[:2] == [None, None], out[:2000]
    assert isinstance(errors[2], OverflowDetected), out[-3000:]
    assert errors[2].detection["phase"] == "forward"
    assert out.splitlines()[-2] == f"Source: born in forward of {culprit} ({errors[2].detection['class']}): " \
                                   f"output from finite inputs and weights", out[-3000:]
    # the product of the scaled weight: a matmul, on the line of the model's code that calls it
    op = errors[2].detection["op"]
    assert op["op"] in ("aten.addmm", "aten.mm") and op["phase"] == "forward", op
    assert op["what"].startswith("inf from finite inputs (input abs max "), op
    assert os.path.basename(os.path.dirname(op["file"])) in ("transformers", name), op
    assert out.splitlines()[-1] == f"Op: {op['op']} at {op['file']}:{op['line']}: {op['what']}; reproduced {op['reproduced']}"


@pytest.mark.parametrize("check", CHECKS)
def test_a_watched_model_can_be_copied_and_saved(check):
    import copy
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    watch(model, check=check)
    model(torch.randn(2, 4)).sum().backward()
    copied = copy.deepcopy(model)
    assert len(pickle.dumps(model)) < 1 << 20  # no device buffer, no cache
    copied(torch.randn(2, 4)).sum().backward()  # the copy's hooks still work
    with torch.no_grad():
        copied[1].weight.fill_(float("inf"))
    out, error = capture(lambda: copied(torch.randn(2, 4)))
    assert isinstance(error, OverflowDetected) and "weight has infs" in out


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("route", ["sequential", "inputs_embeds"])
def test_a_nan_in_the_input_batch_is_attributed_to_the_batch_for_any_model(check, route):
    if route == "sequential":
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        x = torch.ones(2, 4)
        x[1, 0] = float("nan")
        call, entry, where = (lambda: model(x)), "input[0]", "Where: row 1 of 2; first at [1, 0]; 1 of 8 elements is nan"
    else:
        model = models.gpt2()
        embeds = torch.randn(2, 8, 16)
        embeds[1, 3, 5] = float("nan")
        call, entry = (lambda: model(inputs_embeds=embeds)), "input[inputs_embeds]"
        where = "Where: batch row 1 of 2; first at [1, 3, 5] (token 3); 1 of 256 elements is nan"
    watch(model, check=check)
    out, error = capture(call)
    assert isinstance(error, OverflowDetected)
    lines = out.splitlines()
    assert lines[-2:] == [where, f"Source: came in from outside, in the input batch: (model) "
                                 f"({type(model).__name__}) {entry}"], lines[-3:]


@pytest.mark.parametrize("frames", [1, 3, 40])
@pytest.mark.parametrize("finite_steps", [0, 2])
@pytest.mark.parametrize("backward", [False, True])
def test_a_report_is_the_same_whether_finite_passes_made_every_frame_or_only_those_kept(tmp_path, frames,
                                                                                        finite_steps, backward):
    """A pass without a nan/inf makes only the frames its ring keeps; with a log it makes each call's.
    The report of a later detection (forward and gradient frames, batch lines) is the same."""
    def run(log):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        detector = watch(model, max_frames_to_save=frames, log=log, backward=backward)
        x = torch.randn(3, 4)
        bad = x.clone()
        bad[1, 2] = INF
        try:
            for inputs in [x] * finite_steps + [bad]:
                model(inputs).sum().backward()
        except OverflowDetected as error:
            return detector, str(error)

    plain, error = capture(lambda: run(None))
    logged, logged_error = capture(lambda: run(str(tmp_path / "run.jsonl")))
    assert (plain, error) == (logged, logged_error)
    assert f"Starting batch number={finite_steps}" in plain and "inf" in plain


def test_calls_dropped_from_the_ring_leave_the_lines_their_frames_would_have_left():
    """ReferenceState.drop_calls against each call's open, save and close, over random passes of
    forward calls (the model's last), gradient frames and recomputed forward calls."""
    import random

    from overflow_fast.hooks.decisions import Pending
    from overflow_fast.hooks.frames import BACKWARD, FORWARD, Frame
    from overflow_fast.hooks.reference import ReferenceState

    rng = random.Random(5)
    for _ in range(200):
        counter = ReferenceState(21, [])
        calls = []
        for _ in range(rng.randint(1, 4)):
            calls += [(counter.count(False), FORWARD) for _ in range(rng.randint(0, 3))]
            calls.append((counter.count(True), FORWARD))
            for _ in range(rng.randint(0, 4)):
                recomputed = rng.random() < 0.3
                calls.append((counter.count(False, recomputed=True), FORWARD) if recomputed
                             else (counter.count_backward(), BACKWARD))
        start = rng.randint(0, len(calls))
        dropped, each = ReferenceState(3, []), ReferenceState(3, [])
        for state in (dropped, each):  # the calls before: kept the ordinary way
            for call, phase in calls[:start]:
                state.open(call)
                state.save(Frame("m", "Linear", [], [], phase))
                state.close(call)
        dropped.drop_calls([Pending(call, None, [], [], None, phase, None) for call, phase in calls[start:]])
        for call, phase in calls[start:]:
            each.open(call)
            each.save(Frame("m", "Linear", [], [], phase))
            each.close(call)
        assert dropped.frame == each.frame
