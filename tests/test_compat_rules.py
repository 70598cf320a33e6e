"""One toy module per rule of the reference , compared byte for byte, in both check modes."""

import contextlib
import io

import pytest
import torch
from torch import nn

from compat import assert_identical, forward

CHECKS = ["module", "batch"]
INF, NAN = float("inf"), float("nan")


class Odd(nn.Module):
    """Takes None and non-tensors positionally; returns nested tuples of every kind."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, maybe, scale):
        y = self.proj(x) * scale
        return y, (y, None, "text", (y,)), [y], None


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, None, 2)


class Shared(nn.Module):
    """One Linear under two names and called twice: first name wins, hooks fire per registration."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.block = nn.Sequential(self.a, nn.ReLU())

    def forward(self, x):
        return self.block(self.a(x))


class Scaled(nn.Module):
    """A chain whose last layer multiplies by a factor: pick the factor to overflow or not."""

    def __init__(self, factor=1.0, depth=4, dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))
        self.factor = factor
        self.to(dtype)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.factor


class Dictionary(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return {"out": self.lin(x)}


def batches(n, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=generator).to(dtype) for _ in range(n)]


def with_value(data, batch, value, at=(0, 0)):
    """``data`` with ``value`` planted at ``at`` in ``data[batch]`` (a copy; the rest is shared)."""
    data = list(data)
    data[batch] = data[batch].clone()
    data[batch][at] = value
    return data


def make(cls, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **kwargs)


@pytest.mark.parametrize("check", CHECKS)
def test_none_non_tensor_and_nested_outputs(check):
    out, _, _ = assert_identical(make(Wrapper, make(Odd)), batches(2), check=check, trace_batch_nums=[0, 1])
    for piece in ("None input[1]", "not a tensor input[2]", "output[1][0]", "None output[1][1]",
                  "not a tensor output[1][2]", "not a tensor output[1][3]", "not a tensor output[2]"):
        assert piece in out


@pytest.mark.parametrize("check", CHECKS)
def test_dict_output_is_not_a_tensor(check):
    out, _, _ = assert_identical(make(Dictionary), batches(1), check=check, trace_batch_nums=[0])
    assert "not a tensor output" in out


@pytest.mark.parametrize("check", CHECKS)
def test_shared_and_reentered_modules(check):
    out, _, _ = assert_identical(make(Shared), batches(2), check=check, trace_batch_nums=[1])
    assert out.count(" a Linear") == 4  # two calls, each hook registered twice


@pytest.mark.parametrize("check", CHECKS)
def test_shared_module_overflow(check):
    model = make(Shared)
    with torch.no_grad():
        model.a.weight[0, 0] = INF
    assert_identical(model, batches(2), check=check)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("max_frames", [0, 1, 3, 21])
def test_overflow_in_last_layer_frames_bound(check, max_frames):
    # with 0 frames only one batch: after a dump the reference's ring is an unbounded list
    out, outcomes, _ = assert_identical(
        make(Scaled, factor=INF), batches(1 if max_frames == 0 else 2), check=check, max_frames_to_save=max_frames
    )
    assert outcomes[0][0] == "ValueError"


@pytest.mark.parametrize("check", CHECKS)
def test_overflow_in_a_middle_layer(check):
    model = make(Scaled, depth=6)
    with torch.no_grad():
        model.layers[2].bias[1] = NAN
        model.layers[4].weight[0, 0] = INF
    out, _, _ = assert_identical(model, batches(3), check=check, max_frames_to_save=5)
    assert "bias has nans" in out and "output has nans" in out


@pytest.mark.parametrize("check", CHECKS)
def test_nan_and_inf_in_one_tensor(check):
    x = torch.tensor([[1.0, NAN, INF, -INF]])
    assert_identical(make(Scaled), [x], check=check)


@pytest.mark.parametrize("check", CHECKS)
def test_overflow_after_clean_batches(check):
    # batch 2 holds the inf: the report names batch_number=2 and keeps frames of earlier batches
    data = with_value(batches(4), 2, INF)
    assert_identical(make(Scaled, depth=2), data, check=check, max_frames_to_save=9)


@pytest.mark.parametrize("max_frames", [1, 2, 3, 4, 5, 6, 7, 8, 13, None])
@pytest.mark.parametrize("check", ["module", "batch"])
def test_clean_batches_then_an_overflow_for_every_ring_size(check, max_frames):
    # a clean forward's read brings only the rows of the frames the ring keeps: ring sizes
    # shorter than a forward's 3 calls, as long, up to twice as long and longer, each keeping
    # frames of earlier (clean) forwards that the report then prints (a ring of 0 frames takes
    # the reference's unbounded-list quirk after a dump: test_overflow_in_last_layer_frames_bound)
    data = with_value(batches(5), 3, INF)
    assert_identical(make(Scaled, depth=2), data, check=check, max_frames_to_save=max_frames)


@pytest.mark.parametrize("check", CHECKS)
def test_overflow_inside_a_traced_batch_then_next_batch(check):
    # detection is off while tracing, but the flag sticks: the next batch raises at its first module
    data = with_value(batches(3), 1, NAN, at=(1, 1))
    assert_identical(make(Scaled, depth=2), data, check=check, trace_batch_nums=[1])


@pytest.mark.parametrize("check", CHECKS)
def test_abort_after_batch(check):
    _, outcomes, _ = assert_identical(make(Scaled, depth=2), batches(4), check=check, abort_after_batch_num=1)
    assert outcomes[0] is None and outcomes[1][0] == "ValueError" and "aborting after 2" in outcomes[1][1]


@pytest.mark.parametrize("check", CHECKS)
def test_abort_and_overflow_in_the_same_batch(check):
    data = with_value(batches(2), 1, INF)
    assert_identical(make(Scaled, depth=2), data, check=check, abort_after_batch_num=1)


@pytest.mark.parametrize("check", CHECKS)
def test_model_without_children(check):
    model = make(nn.Linear, 4, 4)
    data = with_value(batches(3), 2, NAN)
    assert_identical(model, data, check=check, trace_batch_nums=[1])


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision(check, dtype):
    assert_identical(make(Scaled, factor=7e4, dtype=dtype), batches(2, dtype), check=check)


@pytest.mark.parametrize("check", CHECKS)
def test_integer_inputs(check):
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, offsets):
            return self.emb(ids + offsets)

    ids = torch.tensor([[1, 2, 3]])
    offsets = torch.tensor([[0, -1, 2]], dtype=torch.int32)

    def steps(model, batch):
        with torch.no_grad():
            model(*batch)

    assert_identical(make(Embed), [(ids, offsets)] * 2, steps=steps, check=check, trace_batch_nums=[0, 1])


@pytest.mark.parametrize("check", CHECKS)
def test_training_with_backward(check):
    model = make(Scaled, depth=3)

    def steps(m, batch):
        m(batch).sum().backward()

    data = with_value(batches(3), 2, INF)
    assert_identical(model, data, steps=steps, check=check, trace_batch_nums=[0])


def test_helpers_match_reference(capsys):
    from transformers.debug_utils import detect_overflow as ref_detect, get_abs_min_max as ref_get

    import overflow_fast

    values = [
        torch.tensor([1.5, -2.0, 0.0]),
        torch.tensor([NAN, 1.0]),
        torch.tensor([INF, -INF, 3.0], dtype=torch.float16),
        torch.tensor([-7, 3], dtype=torch.int64),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.tensor([[1e-40, 3.0]]).t(),
    ]
    for v in values:
        assert overflow_fast.get_abs_min_max(v, "ctx") == ref_get(v, "ctx")
        want_result = ref_detect(v, "ctx")
        want_out = capsys.readouterr().out
        assert overflow_fast.detect_overflow(v, "ctx") == want_result
        assert capsys.readouterr().out == want_out


def test_debug_option_matches_reference():
    from transformers.debug_utils import DebugOption as Ref

    from overflow_fast import DebugOption

    assert [(o.name, o.value) for o in DebugOption] == [(o.name, o.value) for o in Ref]
    assert DebugOption("underflow_overflow") == "underflow_overflow"
    with pytest.raises(ValueError) as ours:
        DebugOption("nope")
    with pytest.raises(ValueError) as theirs:
        Ref("nope")
    assert str(ours.value) == str(theirs.value)


def test_same_attributes_as_reference():
    from compat import ReferenceDetector

    from overflow_fast import DebugUnderflowOverflow

    ref = ReferenceDetector(make(Scaled), max_frames_to_save=5, trace_batch_nums=[2], abort_after_batch_num=7)
    ours = DebugUnderflowOverflow(make(Scaled), max_frames_to_save=5, trace_batch_nums=[2], abort_after_batch_num=7)
    for name in ("trace_batch_nums", "abort_after_batch_num", "frame", "batch_number", "total_calls",
                 "detected_overflow", "prefix"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.frames.maxlen == ref.frames.maxlen
    assert list(ours.module_names.values()) == list(ref.module_names.values())
    for method in ("save_frame", "expand_frame", "trace_frames", "reset_saved_frames", "dump_saved_frames",
                   "analyse_model", "analyse_variable", "batch_start_frame", "batch_end_frame", "create_frame",
                   "register_forward_hook", "forward_hook"):
        assert callable(getattr(ours, method)), method


class InPlace(nn.Module):
    """The same tensor object reaches several hooks, changed in place between them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Identity()
        self.c = nn.Identity()

    def forward(self, x):
        y = self.a(x)
        y = self.b(y)  # Identity returns the very same tensor object
        y.mul_(1e39)  # overflows float32 in place: same object, new version
        return self.c(y)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("reuse_stats", [True, False])
def test_in_place_change_between_hooks_is_seen(check, reuse_stats):
    from compat import ReferenceDetector, run
    from overflow_fast import DebugUnderflowOverflow

    data = batches(2)
    want = run(ReferenceDetector, make(InPlace), data, forward)[:2]
    got = run(DebugUnderflowOverflow, make(InPlace), data, forward, check=check, reuse_stats=reuse_stats)[:2]
    assert got == want
    assert "c Identity" in got[0] and "input[0] has infs" in got[0]


@pytest.mark.parametrize("check", CHECKS)
def test_under_inference_mode(check):
    # inference tensors have no version counter: they are simply read every time
    def steps(model, batch):
        with torch.inference_mode():
            model(batch)

    data = with_value(batches(3), 2, INF, at=(0, 1))
    assert_identical(make(Scaled, depth=3), data, steps=steps, check=check, trace_batch_nums=[0])


class TwoNamesOneParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.alias = self.w  # the same tensor registered twice: named_parameters keeps the first
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x @ self.w + self.b


@pytest.mark.parametrize("check", CHECKS)
def test_parameter_registered_under_two_names(check):
    out, _, _ = assert_identical(make(TwoNamesOneParameter), batches(1), check=check, trace_batch_nums=[0])
    assert " weight" not in out and "alias" not in out and "\n" in out


@pytest.mark.parametrize("check", CHECKS)
def test_trace_prints_every_frame_even_with_no_ring(check):
    # the reference prints each traced frame whatever max_frames_to_save is, 0 included
    out, _, _ = assert_identical(make(Scaled, depth=2), batches(2), check=check, max_frames_to_save=0,
                                 trace_batch_nums=[0, 1])
    assert out.count("layers.1 Linear") == 2


def test_analyse_variable_matches_reference():
    from compat import ReferenceDetector

    from overflow_fast import DebugUnderflowOverflow

    values = (torch.tensor([1.0, NAN, INF]), None, 3, torch.tensor([2, -5]), torch.tensor(0.5, dtype=torch.float16))
    results = []
    for cls in (ReferenceDetector, DebugUnderflowOverflow):
        detector = cls(nn.Linear(2, 2))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for value in values:
                detector.analyse_variable(value, "ctx")
        results.append((out.getvalue(), list(detector.frame), detector.detected_overflow))
    assert results[0] == results[1]
    assert results[1][2] is True
