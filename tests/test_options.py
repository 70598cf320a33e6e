"""Options beyond the reference, all off by default (the default output is covered byte for byte
by the compatibility tests): keyword inputs (kwargs=True) and tensors inside containers
(containers=True), each against hand-built ground truth and on real transformers models."""

import dataclasses

import pytest
import torch
from torch import nn

import models
from compat import ReferenceDetector, capture, run
from overflow_fast import DebugUnderflowOverflow, watch
from overflow_fast.hooks.detector import WATCH_DEFAULTS

CHECKS = ("module", "batch")
NAN = float("nan")


class KeywordOnly(nn.Module):
    """Called the way modern transformers call attention and decoder layers: by keyword."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, *, hidden_states, scale=None, use_cache=True):
        return self.proj(hidden_states) * (1 if scale is None else scale)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = KeywordOnly()

    def forward(self, x, scale=None):
        return self.layer(hidden_states=x, scale=scale)


@pytest.mark.parametrize("check", CHECKS)
def test_keyword_tensors_get_lines_named_by_keyword(check):
    torch.manual_seed(0)
    model = Outer()
    DebugUnderflowOverflow(model, check=check, kwargs=True, trace_batch_nums=[0])
    x = torch.full((1, 4), 2.0)
    out, error = capture(lambda: model(x, scale=torch.tensor(3.0)))
    assert error is None
    lines = out.splitlines()
    layer = lines.index("                  layer KeywordOnly")
    # the positional inputs (none), then the keyword tensors in call order; non-tensors get no line
    assert lines[layer + 1] == "2.00e+00 2.00e+00 input[hidden_states]"
    assert lines[layer + 2] == "3.00e+00 3.00e+00 input[scale]"
    assert lines[layer + 3].endswith(" output")
    assert "use_cache" not in out
    # the top-level model was called with a positional and a keyword tensor
    assert "2.00e+00 2.00e+00 input[0]" in out and "3.00e+00 3.00e+00 input[scale]" in out


@pytest.mark.parametrize("check", CHECKS)
def test_nan_in_a_keyword_input_is_detected_where_the_reference_sees_nothing(check):
    class Gate(nn.Module):
        def forward(self, *, hidden_states):
            return torch.zeros_like(hidden_states)  # finite whatever comes in

    class ZeroOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Gate()

        def forward(self, x):
            return self.layer(hidden_states=x)

    x = torch.tensor([[1.0, NAN, 2.0, 3.0]])
    ref_out, ref_outcomes, _ = run(ReferenceDetector, ZeroOut(), [x], lambda m, b: m(b))
    assert ref_outcomes == [("ValueError", ref_outcomes[0][1])]  # the reference sees x as input[0] of the top
    model = ZeroOut()
    out, error = capture(lambda: (DebugUnderflowOverflow(model, check=check, kwargs=True), model(x)))
    assert error is not None
    # found one module earlier than the reference, in the frame of the module that received it
    assert out.splitlines()[0] == "input[hidden_states] has nans"
    # and it was in the model's own input: it came in with the batch
    assert out.endswith("                  layer Gate\n     nan      nan input[hidden_states]\n"
                        "0.00e+00 0.00e+00 output\n\n\n\nWhere: row 0 of 1; first at [0, 1]; 1 of 4 elements is nan\n"
                        "Source: came in from outside, in the input batch: (model) (ZeroOut) input[0]\n")


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    rest: list


class Structured(nn.Module):
    def forward(self, x):
        return {"loss": x.sum(), "parts": [x, (x * 2, None)], "pair": Pair(x + 1, [x - 1, "tag"]),
                "note": "text"}


@pytest.mark.parametrize("check", CHECKS)
def test_tensors_inside_containers_get_lines_named_by_their_path(check):
    model = nn.Sequential(Structured())
    DebugUnderflowOverflow(model, check=check, containers=True, trace_batch_nums=[0])
    out, error = capture(lambda: model(torch.ones(1, 2)))
    assert error is None
    lines = out.splitlines()
    start = lines.index("                  0 Structured")
    assert lines[start + 1: start + 8] == [
        "1.00e+00 1.00e+00 input[0]",
        "2.00e+00 2.00e+00 output[loss]",
        "1.00e+00 1.00e+00 output[parts][0]",
        "2.00e+00 2.00e+00 output[parts][1][0]",
        "2.00e+00 2.00e+00 output[pair][first]",
        "0.00e+00 0.00e+00 output[pair][rest][0]",
        "                   Sequential",
    ]


@pytest.mark.parametrize("check", CHECKS)
def test_containers_off_keeps_the_references_lines(check):
    model = nn.Sequential(Structured())
    (want, _, _), (got, _, _) = [
        run(cls, model, [torch.ones(1, 2)], lambda m, b: m(b), trace_batch_nums=[0], **extra)
        for cls, extra in ((ReferenceDetector, {}), (DebugUnderflowOverflow, {"check": check}))
    ]
    assert got == want and "not a tensor output" in got


@pytest.mark.parametrize("check", CHECKS)
def test_nan_loss_in_a_model_output_is_detected(check):
    # every label -100: the mean over no tokens is nan; the reference prints `not a tensor output`
    model = models.gpt2()
    ids = models.token_batch(0)
    labels = torch.full_like(ids, -100)
    ref_out, ref_outcomes, _ = run(ReferenceDetector, models.gpt2(), [ids],
                                   lambda m, b: m(input_ids=b, labels=labels))
    assert ref_outcomes == [None]
    DebugUnderflowOverflow(model, check=check, containers=True)
    out, error = capture(lambda: model(input_ids=ids, labels=labels))
    assert error is not None
    assert out.splitlines()[0] == "output[loss] has nans"
    assert "                   GPT2LMHeadModel" in out and "     nan      nan output[loss]" in out


@pytest.mark.parametrize("check", CHECKS)
def test_every_llama_frame_shows_an_input_with_kwargs(check):
    model = models.llama()
    ids = models.token_batch(1)
    frames_without_input = {}
    for kwargs in (False, True):
        out, outcomes, _ = run(DebugUnderflowOverflow, models.llama(), [ids], lambda m, b: m(b),
                               check=check, trace_batch_nums=[0], kwargs=kwargs)
        assert outcomes == [None]
        frames = out.split("\n                  ")[1:]
        frames_without_input[kwargs] = [f.splitlines()[0] for f in frames
                                        if " input" not in f and not f.startswith("***")]
    assert frames_without_input[False]  # the reference's view: layers called by keyword show no input
    assert frames_without_input[True] == []
    del model


@pytest.mark.parametrize("check", CHECKS)
def test_nested_model_outputs_are_opened_by_path(check):
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

    class Nested(nn.Module):
        def forward(self, x):
            inner = BaseModelOutputWithPast(last_hidden_state=x * 2, hidden_states=(x, x * 3))
            return CausalLMOutputWithPast(loss=(x * NAN).sum(), logits=x + 1, hidden_states=inner)

    model = nn.Sequential(Nested())
    DebugUnderflowOverflow(model, check=check, containers=True)
    out, error = capture(lambda: model(torch.ones(1, 2)))
    assert error is not None
    lines = out.splitlines()
    assert lines[0] == "output[loss] has nans"
    frame = out.split("                  0 Nested\n")[1].split("\n\n")[0].splitlines()
    assert frame == [
        "1.00e+00 1.00e+00 input[0]",
        "     nan      nan output[loss]",
        "2.00e+00 2.00e+00 output[logits]",
        "2.00e+00 2.00e+00 output[hidden_states][last_hidden_state]",
        "1.00e+00 1.00e+00 output[hidden_states][hidden_states][0]",
        "3.00e+00 3.00e+00 output[hidden_states][hidden_states][1]",
    ]


# -- every option is validated once, with a message naming it -----------------------------------------

BAD_OPTIONS = [
    ({"reuse_stats": "no"}, TypeError, "reuse_stats takes True or False"),
    ({"kwargs": 1}, TypeError, "kwargs takes True or False"),
    ({"containers": None}, TypeError, "containers takes True or False"),
    ({"backward": "yes"}, TypeError, "backward takes True or False"),
    ({"defer": 0}, TypeError, "defer takes True or False"),
    ({"sync": "false"}, TypeError, "sync takes True or False"),
    ({"warn_gradients": 1.0}, TypeError, "warn_gradients takes True or False"),
    ({"ignore": 5}, TypeError, "ignore takes a pattern"),
    ({"ignore": [b"attn"]}, TypeError, "ignore takes a pattern"),
    ({"ignore": b"attn"}, TypeError, "ignore takes a pattern"),
    ({"log": ""}, ValueError, "log takes a non-empty path"),
    ({"log": ["run.jsonl", ""]}, ValueError, "log takes a non-empty path"),
    ({"log": []}, ValueError, "log takes a path"),
    ({"log": 3}, TypeError, "log takes a path"),
    ({"log_every": 0}, ValueError, "log_every takes an int >= 1"),
    ({"on_detect": "skipp"}, ValueError, "on_detect takes one of 'raise', 'warn', 'record', 'skip' or a callable"),
    ({"on_detect": 3}, TypeError, "on_detect takes one of"),
    ({"check": "Batch"}, ValueError, "check takes one of 'module', 'batch'"),
    ({"check": None}, TypeError, "check takes one of"),
    ({"warn_above": 1.5}, ValueError, r"warn_above takes a fraction in \(0, 1\]"),
    ({"warn_above": "0.5"}, TypeError, "warn_above takes a fraction"),
    ({"sync_timeout": -1}, ValueError, "sync_timeout takes a positive time"),
    ({"sync_timeout": "10s"}, TypeError, "sync_timeout takes seconds"),
    ({"max_skips": -1}, ValueError, "max_skips takes an int >= 0"),
    ({"max_backoffs": -1}, ValueError, "max_backoffs takes an int >= 0"),
    ({"min_loss_scale": -1.0}, ValueError, "min_loss_scale takes a finite number >= 0"),
    ({"min_loss_scale": float("nan")}, ValueError, "min_loss_scale takes a finite number >= 0"),
    ({"min_loss_scale": "1"}, TypeError, "min_loss_scale takes a number >= 0"),
    ({"find_op": "yes"}, TypeError, "find_op takes True or False"),
    ({"repro": ""}, ValueError, "repro takes a folder"),
    ({"repro": 3}, TypeError, "repro takes a folder"),
    ({"buffer_rows": 2.0}, ValueError, "buffer_rows takes an int >= 1"),
    ({"backend": "gpu"}, ValueError, "backend takes one of"),
    ({"no_such_option": 1}, TypeError, "no_such_option"),
]


def _integrations():
    builders = {"DebugUnderflowOverflow": lambda options: DebugUnderflowOverflow(nn.Linear(2, 2), **options),
                "watch": lambda options: watch(nn.Linear(2, 2), **options)}
    try:
        from overflow_fast.integrations import transformers as hf

        builders["Trainer DetectorCallback"] = lambda options: hf.DetectorCallback(**options)
        builders["use_in_trainer"] = lambda options: hf.use_in_trainer(**options).undo()
    except ImportError:
        pass
    try:
        from overflow_fast.integrations import lightning

        builders["Lightning DetectorCallback"] = lambda options: lightning.DetectorCallback(**options)
    except ImportError:
        pass
    return builders


@pytest.mark.parametrize("build", sorted(_integrations()))
@pytest.mark.parametrize("options, error, message", BAD_OPTIONS, ids=[str(o) for o, _, _ in BAD_OPTIONS])
def test_a_bad_option_fails_when_it_is_given_with_a_message_naming_it(build, options, error, message):
    with pytest.raises(error, match=message):
        _integrations()[build](options)


def test_watch_lists_every_option_in_its_signature():
    import inspect

    from overflow_fast.hooks.options import Options

    detector = inspect.signature(DebugUnderflowOverflow).parameters
    options = {field.name for field in dataclasses.fields(Options)}
    # and **unknown, which names the nearest option of a misspelled one
    assert set(inspect.signature(watch).parameters) - {"model", "unknown"} == options == set(detector) - {"model", "unknown"}
    for name in options - set(WATCH_DEFAULTS):  # watch's own defaults aside, the drop-in's
        assert inspect.signature(watch).parameters[name].default == detector[name].default, name


def test_the_signatures_defaults_are_the_declared_ones():
    import inspect

    from overflow_fast.hooks.options import Options

    detector = inspect.signature(DebugUnderflowOverflow).parameters
    watched = inspect.signature(watch).parameters
    for field in dataclasses.fields(Options):
        assert detector[field.name].default == field.default, field.name
        assert watched[field.name].default == WATCH_DEFAULTS.get(field.name, field.default), field.name
    assert set(WATCH_DEFAULTS) <= {field.name for field in dataclasses.fields(Options)}
    # the defaults pass their own checks unchanged (trace_batch_nums' None is the reference's empty list)
    assert Options.of() == dataclasses.replace(Options(), trace_batch_nums=[])


def test_the_detectors_options_are_read_only():
    # a changed copy that nothing reads would mislead: the options cannot be changed after the fact
    detector = watch(nn.Linear(2, 2))
    try:
        assert detector.options.check == detector.check == "batch" and detector.backward is True
        with pytest.raises(AttributeError):
            detector.check = "module"
        with pytest.raises(dataclasses.FrozenInstanceError):
            detector.options.check = "module"
    finally:
        detector.remove()
