"""The Where: line is right or silent, on every read path: it is shown under no_grad and inference
mode (where each call lets go of its tensors when it returns, its tensor is brought back by running
its pass again), and a tensor whose version changed since its hook read it (a batch reversed in
place, a gradient changed by a later hook) is said to have changed, never described: an in-place
reorder keeps every count, and would name the wrong sample."""

import contextlib

import pytest
import torch
from torch import nn

from compat import capture
from overflow_fast import DebugUnderflowOverflow, watch

MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
CHECKS = ("module", "batch")
SAMPLES = list(range(100, 105))
ROW_1 = "Where: batch row 1 of 5 (sample 101); first at [1, 1]; 1 of 20 elements is inf"
CHANGED = ("Where: not shown for output (it changed after its hook (in place, or its memory swapped): what it "
           "holds now is not what the hook read)")


class Net(nn.Module):
    """``b``'s output overflows in row 1 alone (sample 101); with ``reverse`` the parent then reverses
    the batch in place (row 1 moves to row 3, sample 103), before the next layer."""

    def __init__(self, reverse=False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.reverse = reverse
        with torch.no_grad():
            for layer in (self.a, self.b):
                layer.weight.zero_()
                layer.bias.zero_()
            self.a.weight[2, 0] = self.a.weight[3, 0] = 1.0
            self.b.weight[1, 2] = self.b.weight[1, 3] = 1e38  # 5e38 + 5e38: inf in column 1

    def forward(self, x):
        h = self.b(self.a(x))
        if self.reverse:
            with torch.no_grad():
                h.copy_(h.flip(0))
        return self.c(h)


def batch():
    x = torch.zeros(5, 4)
    x[1, 0] = 5.0
    return x


def where_of(detector_of, model, mode):
    detector = detector_of(model)
    detector.set_batch(SAMPLES)
    with MODES[mode]():
        out, error = capture(lambda: model(batch()))
    detector.remove()
    assert error is not None, out
    lines = [line for line in out.splitlines() if line.startswith("Where: ")]
    assert len(lines) == 1, out
    return lines[0], error.detection["where"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_line_is_shown_under_no_grad_and_inference_mode(mode, check):
    line, facts = where_of(lambda model: watch(model, check=check), Net(), mode)
    assert line == ROW_1
    assert facts["samples"] == [101] and facts["rows"] == [1]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_batch_reversed_in_place_after_its_hook_never_names_the_wrong_sample(mode, check):
    """Decided in its hook (check="module"), or brought back by running its pass again (no_grad,
    inference mode), the tensor is the one the hook read: row 1. Held since (find_op keeps the
    call under autograd) it is reversed now: said to have changed."""
    line, facts = where_of(lambda model: watch(model, check=check), Net(reverse=True), mode)
    if check == "batch" and mode == "grad":
        assert line == CHANGED and "rows" not in facts
    else:
        assert line == ROW_1


def test_kept_tensors_reordered_in_place_are_never_described_even_without_reuse():
    """Without reuse the hook's read of a tensor is not remembered: the whole row must match, and
    a reversal keeps it; the call's replay is not asked for a tensor it holds. Where the row alone
    cannot tell, the line is only shown when the tensor is certainly the hook's."""
    line, _ = where_of(lambda model: watch(model, check="batch", reuse_stats=False), Net(reverse=True), "grad")
    assert "sample 103" not in line  # never the wrong sample


class Weighted(nn.Module):
    """A weight holding a nan at [2, 1], reversed in place by the parent after its layer ran."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight[2, 1] = float("nan")

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.fc.weight.copy_(self.fc.weight.flip(0))
        return self.out(h)


@pytest.mark.parametrize("check", CHECKS)
def test_a_weight_changed_after_its_hook_is_not_described(check):
    model = Weighted()
    detector = watch(model, check=check)
    out, error = capture(lambda: model(torch.ones(3, 4)))
    detector.remove()
    assert error is not None
    [line] = [line for line in out.splitlines() if line.startswith("Where: ")]
    if check == "batch":
        assert line.startswith("Where: not shown for weight (it changed after its hook"), line
    else:  # decided in the hook: before the reversal
        assert line == "Where: row 2 of 4; first at [2, 1]; 1 of 16 elements is nan"


def test_a_gradient_changed_by_a_later_hook_is_not_described():
    """The detector's gradient hook reads the last layer's weight gradient (inf in row 0 alone); a
    hook registered after it reverses that gradient in place before the backward ends (its pass is
    decided there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    detector = watch(model)
    model[1].weight.register_post_accumulate_grad_hook(
        lambda parameter: (parameter.grad.copy_(parameter.grad.flip(0)), None)[1])
    x = torch.ones(2, 4)
    x[0, 1] = 1e30
    out, error = capture(lambda: (model(x) * torch.tensor([1e30, 1.0, 1.0])).sum().backward())
    detector.remove()
    assert error is not None and "weight.grad has infs" in out, out
    [line] = [line for line in out.splitlines() if line.startswith("Where: ")]
    assert line.startswith("Where: not shown for weight.grad (it changed after its hook"), out


def test_the_drop_in_without_find_op_says_why_under_no_grad():
    model = Net()
    detector = DebugUnderflowOverflow(model, check="batch", containers=True)
    with torch.no_grad():
        out, _ = capture(lambda: model(batch()))
    detector.remove()
    [line] = [line for line in out.splitlines() if line.startswith("Where: ")]
    assert line == ("Where: not shown for output (the call's tensors are not kept: find_op=True keeps them until "
                    "the pass is decided)")


class ReversesItsInput(nn.Module):
    """The model's forward reverses its input batch in place before its layer runs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            x.copy_(x.flip(0))
        return self.fc(x)


@pytest.mark.parametrize("check", CHECKS)
def test_an_input_batch_changed_after_the_model_read_it_is_not_described(check):
    """A nan/inf that came in with the batch is described in the model's input as its hook read it:
    reversed in place since, it is said to have changed."""
    model = ReversesItsInput()
    x = torch.zeros(5, 4)
    x[1, 2] = float("inf")
    detector = watch(model, check=check)
    detector.set_batch(SAMPLES)
    out, error = capture(lambda: model(x))
    detector.remove()
    assert error is not None and "in the input batch" in out, out
    [line] = [line for line in out.splitlines() if line.startswith("Where: ")]
    assert line.startswith("Where: not shown for input[0] (it changed after its hook"), line
