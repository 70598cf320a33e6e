"""Passes that begin inside others count as the reference counts them, byte for byte against the real
transformers DebugUnderflowOverflow on real model classes:
- a forward that a backward runs (a watched probe network called in another model's gradient hook)
  is a pass of its own and counts its batch; only the forward of activation checkpointing's
  recompute counts none, and a probe run by a reentrant checkpoint's inner backward is no recompute;
- nested detectors (one on a model, one on a block): the one whose hooks run first on the block's
  modules (made first) reports, with check="batch" as with check="module"."""

import contextlib
import io
import math
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector

import models
from overflow_fast import DebugUnderflowOverflow

CHECKS = [{"check": "module"}, {"check": "batch"}, {"check": "batch", "defer": True}]
CHECK_IDS = ["module", "batch", "batch-defer"]


def capture(make_detectors, run, steps):
    """(stdout, the message each step raised or None) of ``run(step)`` for each step, after
    ``make_detectors()``."""
    out = io.StringIO()
    outcomes = []
    torch.manual_seed(1234)
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a second detector on a model warns (ours)
        detectors = make_detectors()
        for step in range(steps):
            try:
                run(step)
                outcomes.append(None)
            except ValueError as error:
                outcomes.append(str(error))
    return out.getvalue(), outcomes, detectors


# -- a forward run by a backward -------------------------------------------------------------------

class Probe:
    """A GPT-2 (``main``, not watched) whose first block's output gradient runs another GPT-2 (the
    probe, watched) on it, under no_grad: the probe's forward runs inside main's backward. At
    ``bad_step`` the probe's input holds an inf. ``checkpointed``: main's blocks are checkpointed
    (reentrant: the hook runs in the checkpoint's inner backward, after its recompute)."""

    def __init__(self, bad_step, checkpointed=False):
        self.main = models.gpt2().train()
        self.probe = models.gpt2()
        self.bad_step = bad_step
        self.checkpointed = checkpointed
        self.step = 0
        self.main.transformer.h[0].register_forward_hook(self._hook_output)

    def _hook_output(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(self._run_probe)

    def _run_probe(self, grad):
        with torch.no_grad():
            embeds = grad.detach() * 1e3
            if self.step == self.bad_step:
                embeds[0, 1, 2] = math.inf
            self.probe(inputs_embeds=embeds)

    def __call__(self, step):
        self.step = step
        ids = models.token_batch(step)
        if self.checkpointed:
            self.main.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        self.main(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "reentrant-checkpoint"])
@pytest.mark.parametrize("options", CHECKS[:2], ids=CHECK_IDS[:2])
def test_a_forward_run_by_a_backward_hook_is_a_pass_of_its_own(options, checkpointed):
    want_probe = Probe(bad_step=2, checkpointed=checkpointed)
    got_probe = Probe(bad_step=2, checkpointed=checkpointed)
    want = capture(lambda: ReferenceDetector(want_probe.probe), want_probe, 3)
    got = capture(lambda: DebugUnderflowOverflow(got_probe.probe, **options), got_probe, 3)
    assert "Detected inf/nan during batch_number=2" in want[0]  # the third probe forward: batches 0, 1, 2
    assert got[1] == want[1] and got[0] == want[0]
    assert got[2].batch_number == want[2].batch_number


def test_only_a_checkpoints_recompute_counts_no_batch():
    """The model's own forward recomputed in backward, by either kind of checkpoint, counts once;
    the same model run by a backward hook counts each run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    detector = DebugUnderflowOverflow(model, check="batch")
    for reentrant in (False, True):
        x = torch.randn(2, 4, requires_grad=True)
        checkpoint(model, x, use_reentrant=reentrant).sum().backward()
    assert detector.batch_number == 2
    other = torch.randn(2, 4, requires_grad=True)
    hidden = other * 2
    hidden.register_hook(lambda grad: (model(grad), None)[1])
    hidden.sum().backward()
    assert detector.batch_number == 3
    detector.remove()


# -- nested detectors ------------------------------------------------------------------------------

def gpt2_with_an_inf_weight():
    model = models.gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = math.inf
    return model


@pytest.mark.parametrize("first", ["model", "block"])
@pytest.mark.parametrize("options", CHECKS, ids=CHECK_IDS)
def test_nested_detectors_report_as_the_reference_does(options, first):
    def detectors(cls, model, **kwargs):
        targets = [model, model.transformer.h[1]]
        return lambda: [cls(target, **kwargs) for target in (targets if first == "model" else targets[::-1])]

    def forward(model):
        return lambda step: model(models.token_batch(step))

    want_model, got_model = gpt2_with_an_inf_weight(), gpt2_with_an_inf_weight()
    want = capture(detectors(ReferenceDetector, want_model), forward(want_model), 2)
    got = capture(detectors(DebugUnderflowOverflow, got_model, **options), forward(got_model), 2)
    # the first report is the first detector's: the model's (a full ring), or the block's (its 7 calls)
    first_report = next(line for line in want[0].splitlines() if line.startswith("Last "))
    assert first_report == ("Last 21 forward frames:" if first == "model" else "Last 7 forward frames:")
    assert got[1] == want[1] and got[0] == want[0]


@pytest.mark.parametrize("first", ["batch", "module"])
def test_nested_detectors_of_different_checks_report_as_the_reference_does(first):
    second = "module" if first == "batch" else "batch"

    def detectors(cls, model, ours):
        def make():
            made = [cls(model, **({"check": first} if ours else {}))]
            made.append(cls(model.transformer.h[1], **({"check": second} if ours else {})))
            return made
        return make

    def forward(model):
        return lambda step: model(models.token_batch(step))

    want_model, got_model = gpt2_with_an_inf_weight(), gpt2_with_an_inf_weight()
    want = capture(detectors(ReferenceDetector, want_model, False), forward(want_model), 2)
    got = capture(detectors(DebugUnderflowOverflow, got_model, True), forward(got_model), 2)
    assert got[1] == want[1] and got[0] == want[0]
