"""The Where: line: where the first nan/inf sits in the tensor the Source line names, which rows
of the batch hold them and, where the detector knows them, the dataset samples of those rows and
the token position; the detection, its JSONL record and the reproducer carry the same facts."""

import json

import pytest
import torch
from torch import nn

import models
from compat import capture
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch
from overflow_fast.replay import repro

CHECKS = ("module", "batch")
BATCH, POISONED = 8, 5


def poisoned_rows(width=4):
    """A batch of 8 rows; row 5 holds a sample whose values overflow float32 in the layer below."""
    x = torch.ones(BATCH, width)
    x[POISONED, 2] = 1e38
    return x


def linear_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad():
        model[0].weight.fill_(10.0)  # 1e38 * 10 = inf in every output of row 5
        model[0].bias.zero_()
    return model


def where_line(out):
    lines = [line for line in out.splitlines() if line.startswith("Where: ")]
    assert len(lines) == 1, out[-1500:]
    return lines[0]


@pytest.mark.parametrize("check", CHECKS)
def test_the_poisoned_row_is_named_in_the_line_and_the_record(check, tmp_path):
    model = linear_model()
    log = tmp_path / "run.jsonl"
    detector = watch(model, check=check, log=str(log))
    out, error = capture(lambda: model(poisoned_rows()))
    detector.remove()
    assert isinstance(error, OverflowDetected)
    lines = out.splitlines()
    # Where comes right before Source, and describes the tensor Source names
    assert lines[-3] == "Where: row 5 of 8; first at [5, 0]; 4 of 32 elements are inf"
    assert lines[-2] == "Source: born in forward of 0 (Linear): output from finite inputs and weights"
    where = {"entry": "output", "shape": [8, 4], "rows": [5], "rows_total": 1, "batch": False, "first": [5, 0],
             "token": None, "samples": None, "nan": 0, "posinf": 4, "neginf": 0, "numel": 32}
    assert error.detection["where"] == where
    [record] = [json.loads(line) for line in log.read_text().splitlines() if '"detection"' in line]
    assert record["where"] == where


@pytest.mark.parametrize("check", CHECKS)
def test_set_batch_names_the_samples_of_the_rows(check):
    model = linear_model()
    detector = watch(model, check=check)
    detector.set_batch(range(1000, 1000 + BATCH))  # the dataset indices of the batch's rows
    out, error = capture(lambda: model(poisoned_rows()))
    assert where_line(out) == "Where: batch row 5 of 8 (sample 1005); first at [5, 0]; 4 of 32 elements are inf"
    assert error.detection["where"]["samples"] == [1005] and error.detection["where"]["batch"]


def test_set_batch_refuses_what_is_not_one_index_per_row():
    detector = watch(nn.Linear(2, 2))
    for bad in (3, "0123", torch.ones(4), torch.zeros(2, 2, dtype=torch.long), [1, 2.5]):
        with pytest.raises(TypeError):
            detector.set_batch(bad)
    detector.set_batch(torch.arange(4))
    detector.set_batch(None)


@pytest.mark.parametrize("check", CHECKS)
def test_a_transformers_model_names_batch_rows_and_the_token(check):
    """GPT-2 fed inputs_embeds whose row 5 holds a nan at position 3: it comes in from outside, and
    the line names the batch row and the token."""
    model = models.gpt2()
    embeds = torch.randn(BATCH, 6, 16)
    embeds[POISONED, 3, 7] = float("nan")
    detector = watch(model, check=check)
    out, error = capture(lambda: model(inputs_embeds=embeds))
    detector.remove()
    assert isinstance(error, OverflowDetected)
    # the first module to see it is the embedding dropout, after the position embeddings were added;
    # but the model's own inputs held it first: it came in with the batch
    assert out.splitlines()[-1] == ("Source: came in from outside, in the input batch: (model) (GPT2LMHeadModel) "
                                    "input[inputs_embeds]")
    assert where_line(out) == "Where: batch row 5 of 8; first at [5, 3, 7] (token 3); 1 of 768 elements is nan"


@pytest.mark.parametrize("check", CHECKS)
def test_a_gradient_names_its_rows(check):
    """The gradient arriving at a Linear's output, made non-finite by the next module's backward
    in row 5 only."""

    class InfGradientInRow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            grad[POISONED] = float("inf")
            return grad

    class Culprit(nn.Module):
        def forward(self, x):
            return InfGradientInRow.apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Culprit())
    detector = watch(model, check=check)
    out, error = capture(lambda: model(torch.randn(BATCH, 4)).sum().backward())
    detector.remove()
    assert out.splitlines()[-2].startswith("Source: born in backward, in the gradient arriving at 0 (Linear) "
                                           "output.grad")
    assert where_line(out) == "Where: row 5 of 8; first at [5, 0]; 4 of 32 elements are inf"


def test_a_weight_has_no_batch_rows():
    model = linear_model()
    with torch.no_grad():
        model[0].weight[2, 1] = float("nan")
    watch(model)
    out, _ = capture(lambda: model(torch.ones(BATCH, 4)))
    assert where_line(out) == "Where: row 2 of 4; first at [2, 1]; 1 of 16 elements is nan"


class ZeroAfter(nn.Module):
    """Its layer's output is changed in place right after the layer's hook read it."""

    def __init__(self):
        super().__init__()
        self.fc = linear_model()[0]

    def forward(self, x):
        y = self.fc(x)
        return y.nan_to_num_(posinf=0.0)


def test_a_tensor_changed_after_its_hook_is_not_described():
    """Read at the end of the forward, the output no longer holds what its hook read: the line says
    so rather than guess; decided in the hook (check="module"), it is described."""
    model = ZeroAfter()
    watch(model, check="batch")
    out, error = capture(lambda: model(poisoned_rows()))
    assert where_line(out) == ("Where: not shown for output (it changed after its hook (in place, or its memory "
                               "swapped): what it holds now is not what the hook read)")
    model = ZeroAfter()
    watch(model, check="module")
    out, error = capture(lambda: model(poisoned_rows()))
    assert where_line(out) == "Where: row 5 of 8; first at [5, 0]; 4 of 32 elements are inf"


def test_without_find_op_a_pass_decided_at_its_end_says_why():
    model = linear_model()
    DebugUnderflowOverflow(model, check="batch", containers=True)
    out, error = capture(lambda: model(poisoned_rows()))
    assert where_line(out) == ("Where: not shown for output (the call's tensors are not kept: find_op=True keeps "
                               "them until the pass is decided)")


@pytest.mark.parametrize("check", CHECKS)
def test_the_drop_in_prints_no_where_line_but_its_error_carries_the_facts(check):
    model = linear_model()
    DebugUnderflowOverflow(model, check=check)
    out, error = capture(lambda: model(poisoned_rows()))
    assert "Where:" not in out and "Source:" not in out  # the reference's text, byte for byte
    assert "where" in error.detection


def test_the_reproducer_carries_the_where_facts(tmp_path):
    model = linear_model()
    watch(model, repro=str(tmp_path))
    _, error = capture(lambda: model(poisoned_rows()))
    payload = repro.load_repro(error.detection["repro"])
    assert payload["detection"]["where"]["rows"] == [POISONED]


def test_many_rows_are_counted_not_all_listed():
    model = linear_model()
    watch(model)
    x = torch.ones(20, 4)
    x[::2, 0] = 1e38
    out, error = capture(lambda: model(x))
    assert where_line(out) == ("Where: rows 0, 2, 4, 6, 8, 10, 12, 14 and 2 more of 20; first at [0, 0]; "
                               "40 of 80 elements are inf")
    assert error.detection["where"]["rows"] == list(range(0, 20, 2))
