"""Evaluation keeps nothing: with find_op in check="batch", a forward under no_grad or inference
mode holds no activation that it would not hold without find_op (autograd keeps nothing there, so
neither does a call once it returned); a nan/inf found there still gets its Op line, from a replay
of the outermost call, whose inputs the caller holds anyway."""

import math
import weakref

import pytest
import torch
from torch import nn

from compat import capture
from overflow_fast import OverflowDetected, watch

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


class Layer(nn.Module):
    """Linear + GELU that notes a weak reference to each output it makes, and when asked counts
    how many of the earlier ones are still alive while it runs."""

    def __init__(self, seen):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.seen = seen

    def forward(self, x):
        out = nn.functional.gelu(self.fc(x))
        self.seen.append(weakref.ref(out))
        return out


def alive_at_the_end(find_op, mode, depth=12):
    torch.manual_seed(0)
    seen = []
    model = nn.Sequential(*[Layer(seen) for _ in range(depth)])
    counts = []
    model[-1].register_forward_hook(lambda *_: counts.append(sum(r() is not None for r in seen)))
    watch(model, find_op=find_op)
    with MODES[mode]():
        model(torch.randn(8, 16))
    return counts[0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_forward_without_autograd_holds_no_more_with_find_op(mode):
    without = alive_at_the_end(False, mode)
    assert without <= 2  # the layer's input and its output
    assert alive_at_the_end(True, mode) == without


class Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return torch.exp(h * 200)  # overflows


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("check", ["batch", "module"])
def test_a_nan_in_evaluation_gets_its_op_line(mode, check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), Exp(), nn.Linear(16, 16))
    watch(model, check=check)
    with MODES[mode]():
        out, error = capture(lambda: model(torch.randn(4, 16)))
    assert isinstance(error, OverflowDetected) and error.module_name == "2", out
    op = error.detection["op"]
    assert op["op"] == "aten.exp" and op["file"] == __file__, op
    assert op["line"] == Exp.forward.__code__.co_firstlineno + 2


def test_an_evaluation_keeps_nothing_once_it_returned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    watch(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = model(x)
    refs = [weakref.ref(x), weakref.ref(out)]
    del x, out
    assert [r() for r in refs] == [None, None]
    x = torch.randn(4, 16)
    x[0, 0] = math.nan
    with torch.no_grad():
        _, error = capture(lambda: model(x))
    assert isinstance(error, OverflowDetected) and error.batch_number == 1
