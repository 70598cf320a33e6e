"""Nothing outlives remove(): once a detector is removed (remove(), or the end of its with block),
the model it watched is freed as soon as the user lets go of it, in every mode and every
integration, after a detection too, while the detector itself and the last loss (whose graph
holds the gradient hooks) are still alive. And a detector never removed goes with its model.
The model is held here by a weak reference only."""

import gc
import math
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import overflow_fast
from overflow_fast import DebugUnderflowOverflow


class Block(nn.Module):
    """Keyword inputs and a container output (kwargs=True and containers=True read them)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x, scale=None):
        y = self.act(self.linear(x))
        return {"hidden": y * scale if scale is not None else y, "extra": [y]}


class Net(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 2)
        self.checkpointed = checkpointed
        self.scale = nn.Parameter(torch.tensor(1.5))

    def _block(self, x):
        return self.block(x, scale=self.scale)["hidden"]

    def forward(self, x):
        hidden = checkpoint(self._block, x, use_reentrant=False) if self.checkpointed else self._block(x)
        return self.head(hidden)


@pytest.fixture(autouse=True, scope="module")
def _earlier_objects_frozen():
    """What exists before these tests (the suite's modules, models, frames) is frozen out of the
    collector: each test's gc.collect() then traverses the objects its own run made, the only ones
    that can hold the model, in milliseconds rather than a second in a full suite's heap."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def batch(bad=False):
    x = torch.randn(3, 4)
    if bad:
        x[1, 2] = math.inf
    return x


# name -> (how the detector is made, does the model checkpoint its block)
MODES = {
    "module": (lambda model, tmp: DebugUnderflowOverflow(model), False),
    "batch": (lambda model, tmp: DebugUnderflowOverflow(model, check="batch"), False),
    "module-backward": (lambda model, tmp: DebugUnderflowOverflow(model, backward=True), False),
    "batch-backward-defer": (lambda model, tmp: DebugUnderflowOverflow(model, check="batch", backward=True,
                                                                         defer=True), False),
    "watch": (lambda model, tmp: overflow_fast.watch(model), False),
    "watch-module": (lambda model, tmp: overflow_fast.watch(model, check="module"), False),
    "find_op-repro-log": (lambda model, tmp: overflow_fast.watch(model, repro=str(tmp / "repro"),
                                                                 log=str(tmp / "log.jsonl")), False),
    "kwargs-containers": (lambda model, tmp: DebugUnderflowOverflow(model, kwargs=True, containers=True), False),
    "checkpointed": (lambda model, tmp: overflow_fast.watch(model), True),
    "warn": (lambda model, tmp: overflow_fast.watch(model, on_detect="warn"), False),
    "record": (lambda model, tmp: overflow_fast.watch(model, on_detect="record"), False),
    "record-module": (lambda model, tmp: overflow_fast.watch(model, on_detect="record", check="module"), False),
    "skip": (lambda model, tmp: overflow_fast.watch(model, on_detect="skip"), False),
    "callable": (lambda model, tmp: overflow_fast.watch(model, on_detect=lambda error: None), False),
    "trace": (lambda model, tmp: DebugUnderflowOverflow(model, trace_batch_nums=[1]), False),
    "step": (lambda model, tmp: overflow_fast.watch(model, check="step"), False),
    "step-frames-every": (lambda model, tmp: overflow_fast.watch(model, check="step", frames_every=1), False),
    "step-record": (lambda model, tmp: overflow_fast.watch(model, check="step", on_detect="record"), False),
}


def train(model, detector_of, tmp, ending, bad):
    """Two training steps (the second's input holds an inf when ``bad``) under a detector ended by
    ``ending``: returns the detector and the last loss, which the caller keeps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = None

    def steps(detector):
        nonlocal loss
        for step in range(2):
            optimizer.zero_grad()
            loss = model(batch(bad and step == 1)).square().sum()
            loss.backward()
            optimizer.step()

    detector = detector_of(model, tmp)
    try:
        if ending == "with":
            with detector:
                steps(detector)
        else:
            steps(detector)
            detector.remove()
    except ValueError as error:
        assert bad and "inf/nan detected" in str(error), error
        if ending != "with":
            detector.remove()
    return detector, loss


def assert_freed(reference, *kept):
    gc.collect()
    if reference() is not None:  # name what holds it, to find it fast
        holders = [type(holder).__name__ for holder in gc.get_referrers(reference())]
        raise AssertionError(f"the model is alive after remove(), held by {holders}")
    assert all(item is not None for item in kept)


@pytest.mark.parametrize("ending", ["remove", "with"])
@pytest.mark.parametrize("bad", [False, True], ids=["clean", "detection"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_removed_detector_keeps_nothing_of_the_model_alive(mode, bad, ending, tmp_path, capsys):
    detector_of, checkpointed = MODES[mode]
    model = Net(checkpointed)
    reference = weakref.ref(model)
    detector, loss = train(model, detector_of, tmp_path, ending, bad)
    if bad:
        assert "has infs" in capsys.readouterr().out or "record" in mode
        assert detector.detections or mode in ("module", "batch", "module-backward", "batch-backward-defer",
                                                "kwargs-containers", "trace")
    del model
    # the detector, its detections and the last loss (its graph holds the output hooks) stay alive
    assert_freed(reference, detector, loss)
    assert detector.model is None
    del detector, loss
    gc.collect()


@pytest.mark.parametrize("options", [{"backward": False}, {"backward": True}, {"check": "step"}],
                         ids=["forward", "backward", "step"])
def test_a_detector_never_removed_goes_with_its_model(options):
    """As with the reference: nothing but the model holds it, and its hooks (torch keeps a parameter's
    and an output's gradient hooks where no collector sees them) hold the detector weakly."""
    model = Net()
    reference = weakref.ref(model)
    detector = overflow_fast.watch(model, **options)
    detector_reference = weakref.ref(detector)
    loss = model(batch()).sum()
    loss.backward()
    del model, detector
    assert_freed(reference, loss)
    assert detector_reference() is None


def test_a_copy_of_a_model_carries_its_own_gradient_hooks(capsys):
    """The parameters' hooks hold the detector weakly, yet a deep copy of the model gets hooks on its
    own copy of the detector, reporting its own modules."""
    import copy

    model = Net()
    detector = overflow_fast.watch(model)
    model(batch()).sum().backward()
    clone = copy.deepcopy(model)
    detector.remove()
    with torch.no_grad():
        clone.head.weight[0, 0] = math.inf
    with pytest.raises(ValueError, match="inf/nan detected"):
        clone(batch()).sum().backward()
    assert "head Linear" in capsys.readouterr().out


# -- integrations -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [False, True], ids=["clean", "detection"])
@pytest.mark.parametrize("route", ["callback", "use_in_trainer"])
def test_the_hf_trainer_lets_go_of_the_model(route, bad, tmp_path):
    transformers = pytest.importorskip("transformers")
    import models
    from test_integrations import _Data, _PoisonAt

    from overflow_fast.integrations import transformers as integration

    model = models.gpt2().train()
    reference = weakref.ref(model)
    callback = integration.DetectorCallback() if route == "callback" else None
    handle = integration.use_in_trainer() if route == "use_in_trainer" else None
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        debug="underflow_overflow" if handle is not None else "")
    callbacks = ([callback] if callback is not None else []) + ([_PoisonAt(1)] if bad else [])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)
    del model
    try:
        trainer.train()
    except ValueError as error:
        assert bad and "inf/nan detected" in str(error)
    finally:
        if handle is not None:
            handle.undo()
    detectors = handle.detectors if handle is not None else []
    assert detectors or callback is not None
    del trainer
    try:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # (it holds the last Accelerator's state, not the model)
    except ImportError:
        pass
    assert_freed(reference, *detectors)


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "detection"])
def test_lightning_lets_go_of_the_model(bad):
    pytest.importorskip("lightning.pytorch")
    from test_lightning import Module, loader, trainer

    from overflow_fast.integrations.lightning import DetectorCallback

    detectors = []

    class Callback(DetectorCallback):
        def on_fit_start(self, trainer, pl_module):
            super().on_fit_start(trainer, pl_module)
            detectors.append(self.detector)

    module = Module(bad_step=1 if bad else None)
    reference = weakref.ref(module)
    fit = trainer(Callback(), steps=3)
    try:
        fit.fit(module, loader())
    except ValueError as error:
        assert bad and "inf/nan detected" in str(error)
    # (Lightning's callbacks hold the module's log method: the trainer and its callbacks go too)
    del module, fit
    assert_freed(reference, *detectors)
