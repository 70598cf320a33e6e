"""on_detect="skip": a step in which a nan/inf appears applies no update and training goes on;
on_detect=callable; set_step: detections and errors carry the trainer's step and mode."""

import copy

import pytest
import torch
from torch import nn

from compat import capture
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch

NAN = float("nan")


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def data(count=6, bad=(2,)):
    torch.manual_seed(1)
    batches = [torch.randn(3, 4) for _ in range(count)]
    for index in bad:
        batches[index][1, 2] = NAN
    return batches


def step(model, optimizer, x):
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def same_state(a, b):
    """Parameters and optimizer state equal, bit for bit."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        if not torch.equal(p, q):
            return False
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    return state_a.keys() == state_b.keys() and all(
        torch.equal(torch.as_tensor(state_a[k][name]), torch.as_tensor(state_b[k][name]))
        for k in state_a for name in state_a[k])


@pytest.mark.parametrize("options", [{"check": "batch"}, {"check": "module"}, {"backward": True},
                                     {"watch": True}], ids=["batch", "module", "gradients", "watch"])
def test_a_bad_step_applies_no_update_and_training_goes_on(options):
    batches = data(6, bad=(2, 4))
    control = model_and_optimizer()
    for index, x in enumerate(batches):
        if index not in (2, 4):
            step(*control, x)
    run = model_and_optimizer()
    options = dict(options)
    if options.pop("watch", False):
        detector = watch(run[0], on_detect="skip")
    else:
        detector = DebugUnderflowOverflow(run[0], on_detect="skip", **options)
    outputs = []
    for x in batches:
        out, error = capture(lambda: step(*run, x))
        assert error is None
        outputs.append(out)
    assert same_state(run, control)
    # one report, one detection per skipped step
    assert [index for index, out in enumerate(outputs) if out] == [2, 4]
    assert all(out.count("Detected inf/nan") == 1 and "skipping this step" in out for out in (outputs[2], outputs[4]))
    assert len(detector.detections) == 2
    detector.remove()


def test_after_max_skips_in_a_row_it_raises():
    run = model_and_optimizer()
    detector = DebugUnderflowOverflow(run[0], on_detect="skip", max_skips=2)
    batches = data(5, bad=(1, 2, 3))
    outcomes = []
    for x in batches:
        out, error = capture(lambda: step(*run, x))
        outcomes.append(type(error).__name__ if error else None)
    assert outcomes[:4] == [None, None, None, "OverflowDetected"]
    assert len(detector.detections) == 4  # three skipped steps, then the one that raised


def test_a_clean_step_resets_the_count():
    run = model_and_optimizer()
    DebugUnderflowOverflow(run[0], on_detect="skip", max_skips=1)
    for x in data(6, bad=(1, 3, 5)):
        out, error = capture(lambda: step(*run, x))
        assert error is None


def test_gradient_accumulation_drops_every_micro_batch_of_the_skipped_step():
    # the second micro-batch of a step is clean, the first is not: nothing of that step is applied
    batches = data(6, bad=(2,))
    control = model_and_optimizer()
    run = model_and_optimizer()
    DebugUnderflowOverflow(run[0], on_detect="skip")
    for model, optimizer in (control, run):
        for start in range(0, 6, 2):
            if model is control[0] and start == 2:
                continue
            optimizer.zero_grad()
            for x in batches[start:start + 2]:
                capture(lambda: model(x).square().mean().backward())
            optimizer.step()
    assert same_state(run, control)


def test_on_detect_callable_gets_the_detection_and_its_error_propagates():
    seen = []
    model, optimizer = model_and_optimizer()
    detector = DebugUnderflowOverflow(model, on_detect=seen.append)
    out, error = capture(lambda: [step(model, optimizer, x) for x in data(3, bad=(2,))])
    assert error is None and len(seen) == 1
    assert isinstance(seen[0], OverflowDetected) and seen[0].batch_number == 2 and seen[0].frames
    assert "Detected inf/nan during batch_number=2" in out
    detector.remove()

    def stop(detection):
        raise KeyboardInterrupt("stop here")

    model, optimizer = model_and_optimizer()
    DebugUnderflowOverflow(model, on_detect=stop)
    with pytest.raises(KeyboardInterrupt):
        for x in data(4, bad=(2,)):
            step(model, optimizer, x)


@pytest.mark.parametrize("check", ["module", "batch"])
def test_set_step_is_carried_by_detections_and_errors(check):
    model, optimizer = model_and_optimizer()
    detector = DebugUnderflowOverflow(model, check=check)
    for index, x in enumerate(data(4, bad=(3,))):
        detector.set_step(index // 2, "train")
        out, error = capture(lambda: step(model, optimizer, x))
    assert error.global_step == 1 and error.mode == "train" and error.batch_number == 3
    assert detector.detections[-1]["global_step"] == 1 and detector.detections[-1]["mode"] == "train"
    with pytest.raises(ValueError, match="mode"):
        detector.set_step(1, "training")
    with pytest.raises(ValueError, match="global_step"):
        detector.set_step(-1)


def test_skip_is_copied_with_the_model():
    model, _ = model_and_optimizer()
    DebugUnderflowOverflow(model, on_detect="skip")
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=0.1)
    before = [p.detach().clone() for p in twin.parameters()]
    capture(lambda: step(twin, optimizer, data(1, bad=(0,))[0]))
    assert all(torch.equal(a, b) for a, b in zip(before, twin.parameters()))
