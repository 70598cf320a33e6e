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


# -- an exact no-op update: GradScaler, shared optimizers, copies -----------------------------------

def scaled_run(bad, detector=None, set_to_none=True, zero_grad_after_forward=False, count=7):
    """A float16-style loop with torch.amp.GradScaler on CPU: per step, (weights, optimizer state,
    scale) after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    if detector is not None:
        detector(model)
    states = []
    for x in data(count, bad=bad):
        if not zero_grad_after_forward:
            optimizer.zero_grad(set_to_none=set_to_none)
        loss = model(x).square().mean()
        if zero_grad_after_forward:
            optimizer.zero_grad(set_to_none=set_to_none)
        out, error = capture(lambda: scaler.scale(loss).backward(), catch=Exception)
        assert error is None
        out, error = capture(lambda: (scaler.step(optimizer), scaler.update()), catch=Exception)
        assert error is None, error
        states.append(([p.detach().clone() for p in model.parameters()],
                       {k: v.clone() if torch.is_tensor(v) else v
                        for s in optimizer.state.values() for k, v in s.items()}, scaler.get_scale()))
    return states


def same_states(a, b):
    return len(a) == len(b) and all(
        all(torch.equal(p, q) for p, q in zip(pa, pb)) and sa.keys() == sb.keys()
        and all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa) and ga == gb
        for (pa, sa, ga), (pb, sb, gb) in zip(a, b))


@pytest.mark.parametrize("attach", [lambda m: watch(m, on_detect="skip"),
                                    lambda m: DebugUnderflowOverflow(m, on_detect="skip"),
                                    lambda m: DebugUnderflowOverflow(m, on_detect="skip", check="batch")],
                         ids=["watch", "module", "batch"])
@pytest.mark.parametrize("loop", [{}, {"set_to_none": False}, {"zero_grad_after_forward": True}],
                         ids=["zero_grad", "zero_grad_to_zeros", "zero_grad_after_forward"])
def test_with_a_grad_scaler_the_scaler_steps_and_scales_as_it_would_alone(attach, loop):
    # the nan reaches the gradients: GradScaler itself skips those steps and halves its scale; the
    # detector must neither crash scaler.step nor change what the scaler does, nor skip a later step
    alone = scaled_run(bad=(2, 3), **loop)
    assert alone[2][2] == alone[1][2] / 2  # the scaler found the inf and backed off
    assert same_states(scaled_run(bad=(2, 3), detector=attach, **loop), alone)


def test_a_skip_the_scaler_would_not_make_still_applies_no_update():
    # a nan in the forward that never reaches the loss: the scaler would step; the detector skips,
    # and the scaler's own bookkeeping goes on as with a finite step (its scale grows on schedule)
    class MaskedNan(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.poison = False

        def forward(self, x):
            side = x * NAN if self.poison else x  # computed, never used
            return self.fc(x), side

    def run_steps(attach, poison_at=None, leave_out=None):
        torch.manual_seed(0)
        model = MaskedNan()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        if attach:
            watch(model, on_detect="skip")
        states = []
        for index, x in enumerate(data(6, bad=())):
            if index != leave_out:
                model.poison = index == poison_at
                optimizer.zero_grad()
                capture(lambda: scaler.scale(model(x)[0].square().mean()).backward())
                scaler.step(optimizer)
                scaler.update()
            states.append(([p.detach().clone() for p in model.parameters()],
                           {k: v.clone() for s in optimizer.state.values() for k, v in s.items()},
                           scaler.get_scale()))
        return states

    run = run_steps(True, poison_at=2)
    updates = run_steps(False, leave_out=2)  # the weights and AdamW's state of a run without that update
    scales = run_steps(False)  # the scaler saw finite gradients at every step
    assert same_states([(p, st, None) for p, st, _ in run], [(p, st, None) for p, st, _ in updates])
    assert [g for *_, g in run] == [g for *_, g in scales] and scales[-1][2] > scales[0][2]


def shared_optimizer_run(attach, groups):
    """Five steps of one AdamW over the watched model and another one, the third batch bad; the
    control (``attach`` False) never runs that step at all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    other = nn.Linear(4, 1)  # another model, stepped by the same optimizer
    if groups:
        optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01},
                                       {"params": other.parameters(), "weight_decay": 0.5}], lr=0.1)
    else:
        optimizer = torch.optim.AdamW(list(model.parameters()) + list(other.parameters()), lr=0.1)
    if attach:
        DebugUnderflowOverflow(model, on_detect="skip", check="batch")
    for index, x in enumerate(data(5, bad=(2,))):
        if index == 2 and not attach:
            continue
        optimizer.zero_grad()
        capture(lambda: (model(x).square().mean() + other(x).square().mean()).backward())
        optimizer.step()
    return (model, optimizer), other


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "groups"])
def test_a_skipped_step_leaves_every_parameter_of_the_optimizer_alone(groups):
    run, run_other = shared_optimizer_run(True, groups)
    control, control_other = shared_optimizer_run(False, groups)
    # the other model's nan gradients were not applied, and AdamW's state (step counts, moments) is
    # what it is in a run that never took that step
    assert same_state(run, control)
    assert all(torch.equal(p, q) for p, q in zip(run_other.parameters(), control_other.parameters()))
    assert {int(state["step"]) for state in run[1].state.values()} == {4}


_COPIES_CHILD = """
import copy, gc, json, weakref
import torch
from torch import nn
from torch.optim import optimizer as optim_module
from overflow_fast import DebugUnderflowOverflow

def process_hooks():
    return len(optim_module._global_optimizer_pre_hooks) + len(optim_module._global_optimizer_post_hooks)

counts = {"before": process_hooks()}
model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
detector = DebugUnderflowOverflow(model, on_detect="skip")
counts["one detector"] = process_hooks()
copies = [weakref.ref(copy.deepcopy(model)) for _ in range(30)]
gc.collect()
counts["copies freed"] = sum(ref() is None for ref in copies)
counts["after 30 copies"] = process_hooks()
second = DebugUnderflowOverflow(nn.Linear(4, 4), on_detect="skip")
counts["two detectors"] = process_hooks()
second.remove()
detector.remove()
counts["removed"] = process_hooks()
print(json.dumps(counts))
"""


@pytest.mark.one_path
def test_copies_of_a_skipping_model_hold_no_process_wide_hook_and_are_freed():
    # a fresh process: no other test's detectors are alive (or waiting to be collected)
    import json
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _COPIES_CHILD], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    counts = json.loads(child.stdout.splitlines()[-1])
    assert counts == {"before": 0, "one detector": 2, "copies freed": 30, "after 30 copies": 2,
                      "two detectors": 2, "removed": 0}
