"""overflow_fast in the Hugging Face Trainer, two ways:

- ``Trainer(..., callbacks=[DetectorCallback(**detector_kwargs)])`` attaches
  ``overflow_fast.DebugUnderflowOverflow(model, **detector_kwargs)`` when training begins;
- ``use_in_trainer(**detector_kwargs)`` makes ``TrainingArguments(debug="underflow_overflow")``
  build overflow_fast's detector instead of transformers' own, until its handle's ``undo()``.

Both use ``watch()``'s options unless overridden (``check="batch"``, keyword inputs, containers,
gradient checks), and tell the detector the trainer's optimizer step (``state.global_step``) and
whether the model runs in training or evaluation, so that detections, errors and records carry
them; and, where the training data loader can tell (``samples``), the dataset index of each row of
the batch, which a detection's ``Where:`` line names.

Either way no hook is left on the model once ``train()`` has returned *or raised*, and a detection
raises the reference's ValueError out of ``train()``. A callback never learns that ``train()``
raised, so ``Trainer.train`` is wrapped once per process (a transparent pass-through that, in a
``finally``, removes the detectors this integration attached during that call); a Trainer
subclass whose ``train()`` does not call ``super().train()`` still gets its hooks removed by the
callback's ``on_train_end`` on a normal return.
"""

import functools
import sys
import threading
from typing import Any

try:
    import transformers
    from transformers import Trainer, TrainerCallback
except ImportError as missing:
    raise ImportError(f"overflow_fast.integrations.transformers needs Hugging Face transformers: pip install "
                      f"transformers (import transformers failed: {missing})") from missing

from . import samples
from ..hooks.detector import DebugUnderflowOverflow
from ..hooks.options import WATCH_DEFAULTS, Options, check_names, validated_flag

__all__ = ["DetectorCallback", "TrainerPatch", "use_in_trainer"]

_WRAPPED = "__overflow_fast_wrapped__"
_calls = threading.local()  # the stack of train() calls in progress on this thread


class _Created(list):
    """The detectors built during one ``train()`` call, its Trainer, and what tells a detector the
    Trainer's steps and samples (a ``_Follower``)."""

    trainer = None
    steps = None


def _current_trainer():
    stack = getattr(_calls, "stack", None)
    return stack[-1].trainer if stack else None


class _Follower:
    """Before every forward of the detector's model, tell it the trainer's optimizer step, whether it
    trains or evaluates, and (once ``follow_samples`` was given the training data loader, where that
    loader can tell) the dataset indices of the batch's rows. ``remove()`` undoes all of it."""

    def __init__(self, detector, trainer):
        self.detector, self.trainer = detector, trainer
        self.loader = self.tape = None
        self.batches = samples.Batches()
        self.hook = detector.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.pairing = None  # the get_batch_samples put on the trainer, while samples are followed

    def _before_forward(self, model, args, kwargs):
        state = getattr(self.trainer, "state", None)
        self.detector.set_step(getattr(state, "global_step", None), "train" if model.training else "eval")
        self.detector.set_batch(self.batches.samples_of(args, kwargs) if self.tape is not None else None)

    def follow_samples(self, loader, resumed):
        """Pair the batches the Trainer takes from ``loader`` (its ``get_batch_samples``) with the
        dataset indices its sampler gave. A resumed run skips the batches its first epoch already
        trained: that epoch is not followed."""
        original = getattr(self.trainer, "get_batch_samples", None)
        if loader is None or original is None:
            return
        self.tape = samples.attach(loader, skip_first_pass=resumed)
        if self.tape is None:
            return
        self.loader = loader

        def get_batch_samples(epoch_iterator, num_batches, *args, **kwargs):
            batch_samples, num_items = original(epoch_iterator, num_batches, *args, **kwargs)
            self.batches.pair(self.tape, batch_samples)
            return batch_samples, num_items

        self.pairing = get_batch_samples
        self.trainer.get_batch_samples = get_batch_samples

    def remove(self):
        self.hook.remove()
        if self.pairing is not None and self.trainer.__dict__.get("get_batch_samples") is self.pairing:
            del self.trainer.get_batch_samples  # the class's method again
        self.pairing = None
        if self.loader is not None:
            samples.detach(self.loader)
        self.loader = self.tape = None
        self.detector = self.trainer = None  # nothing of the run stays reachable from here


class _FollowSamples(TrainerCallback):
    """Gives a ``_Follower`` the training data loader when training begins (for ``use_in_trainer``,
    whose detector the Trainer builds before it makes its loader)."""

    def __init__(self, follower):
        self.follower = follower

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.follower.follow_samples(train_dataloader, state.global_step > 0)


def _reporters(trainer):
    """The dashboards the Trainer's ``report_to`` callbacks write to: TensorBoard writers and W&B runs."""
    sinks = []
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        writer = getattr(callback, "tb_writer", None)
        if writer is not None and hasattr(writer, "add_scalar"):
            sinks.append(writer)
        wandb = getattr(callback, "_wandb", None)
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            sinks.append(run)
    return sinks
# Patches not undone yet, oldest first, and the name the Trainer had before the first of them:
# undone in any order, the newest one still active is in place, the original once none is.
_active: list = []
_original: list = []  # [the Trainer module's own DebugUnderflowOverflow] while any patch is active
_patch_lock = threading.Lock()


def _ensure_train_wrapper():
    train = Trainer.train
    if getattr(train, _WRAPPED, False):
        return

    @functools.wraps(train)
    def wrapped_train(self, *args, **kwargs):
        stack = _calls.__dict__.setdefault("stack", [])
        created = _Created()  # detectors built through use_in_trainer() during this call
        created.trainer = self
        stack.append(created)
        try:
            result = train(self, *args, **kwargs)
        except BaseException:
            stack.pop()
            _detach(self, created, quiet=True)  # the error propagating is the one to see
            raise
        stack.pop()
        _detach(self, created, quiet=False)
        return result

    setattr(wrapped_train, _WRAPPED, True)
    Trainer.train = wrapped_train


def _detach(trainer, created, quiet):
    detectors = list(created)
    hooks = [created.steps] if created.steps is not None else []
    handler = getattr(trainer, "callback_handler", None)
    for callback in list(getattr(handler, "callbacks", ())):
        if isinstance(callback, DetectorCallback):
            detector, callback.detector = callback.detector, None
            hooks.append(callback._steps)
            callback._steps = None
            if detector is not None:
                detectors.append(detector)
        elif isinstance(callback, _FollowSamples):
            handler.remove_callback(callback)
    for hook in hooks:
        if hook is not None:
            hook.remove()
    first_error = None
    for detector in detectors:
        try:
            detector.remove()  # runs a pending check (check="batch"): it may raise the ValueError
        except Exception as error:
            if first_error is None:
                first_error = error
    if first_error is not None and not quiet:
        raise first_error


class DetectorCallback(TrainerCallback):
    """Attaches ``overflow_fast.DebugUnderflowOverflow(model, **detector_kwargs)`` (``watch()``'s
    options unless overridden) to the Trainer's model in ``on_train_begin``; its hooks come off
    when ``train()`` returns or raises. ``report_to=True``: the detector's per-module scalars and
    detections also go to the dashboards of the Trainer's ``report_to`` (TensorBoard, W&B), beside
    any ``log=`` given. ``self.detector`` is the detector while training runs (None otherwise)."""

    def __init__(self, report_to: bool = False, **detector_kwargs: Any) -> None:
        check_names(detector_kwargs, also=("report_to",))  # a misspelled one names the nearest
        self.options = Options.of(**{**WATCH_DEFAULTS, **detector_kwargs})  # a bad one fails here, not in train()
        self.report_to = validated_flag("report_to", report_to)
        self.detector = None
        self._steps = None
        _ensure_train_wrapper()

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.detach()  # auto_find_batch_size runs the training loop again
        if model is None:
            raise ValueError("DetectorCallback: the Trainer passed no model to on_train_begin")
        trainer = _current_trainer()
        options = self.options
        if self.report_to and trainer is not None:
            log = options.log
            sinks = ([] if log is None else list(log) if isinstance(log, (list, tuple)) else [log])
            sinks += _reporters(trainer)
            if sinks:
                options = options.changed(log=sinks)
        self.detector = DebugUnderflowOverflow.from_options(model, options)
        if trainer is not None:
            self._steps = _Follower(self.detector, trainer)
            self._steps.follow_samples(train_dataloader, state.global_step > 0)

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    def detach(self):
        """Take the detector's hooks off the model (running any check still pending)."""
        detector, self.detector = self.detector, None
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.remove()
        if detector is not None:
            detector.remove()


def _trainer_module():
    module = sys.modules.get(Trainer.__module__)
    if module is None or not hasattr(module, "DebugUnderflowOverflow"):
        raise RuntimeError(
            f"use_in_trainer: transformers {transformers.__version__} does not build its detector "
            f"through {Trainer.__module__}.DebugUnderflowOverflow; use DetectorCallback instead"
        )
    return module


class TrainerPatch:
    """What :func:`use_in_trainer` returns: ``undo()`` (or leaving a ``with`` block) gives the
    Trainer its own detector back. ``detectors`` lists the detectors built so far."""

    def __init__(self, detector_kwargs):
        self.detector_kwargs = dict(detector_kwargs)
        self.options = Options.of(**{**WATCH_DEFAULTS, **self.detector_kwargs})  # a bad option fails here
        self.detectors = []
        self._module = _trainer_module()
        _ensure_train_wrapper()

        def build(model, *args, **kwargs):
            # the Trainer calls DebugUnderflowOverflow(self.model): our options are the rest
            if args or kwargs:
                detector = DebugUnderflowOverflow(model, *args, **{**WATCH_DEFAULTS, **self.detector_kwargs, **kwargs})
            else:
                detector = DebugUnderflowOverflow.from_options(model, self.options)
            self.detectors.append(detector)
            stack = getattr(_calls, "stack", None)
            if stack:
                stack[-1].append(detector)  # removed when this train() call ends
                stack[-1].steps = _Follower(detector, stack[-1].trainer)
                stack[-1].trainer.add_callback(_FollowSamples(stack[-1].steps))
            return detector

        self._build = build
        with _patch_lock:
            current = self._module.DebugUnderflowOverflow
            if not _active:
                _original[:] = [current]
            _active.append(self)
            self._module.DebugUnderflowOverflow = build
        self.active = True

    def undo(self):
        """Stop building overflow_fast's detector with these options (idempotent): the newest
        handle still active takes over, and once every handle is undone, in whatever order, the
        Trainer has its own detector back. A name someone else set meanwhile is left alone."""
        with _patch_lock:
            if not self.active:
                return
            self.active = False
            ours = {patch._build for patch in _active}
            _active.remove(self)
            if self._module.DebugUnderflowOverflow in ours:
                self._module.DebugUnderflowOverflow = _active[-1]._build if _active else _original[0]
            if not _active:
                _original.clear()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.undo()


def use_in_trainer(**detector_kwargs: Any) -> "TrainerPatch":
    """From now on ``TrainingArguments(debug="underflow_overflow")`` makes the Trainer build
    ``overflow_fast.DebugUnderflowOverflow(model, **detector_kwargs)`` (``watch()``'s options
    unless overridden); its hooks come off when ``train()`` returns or raises. Returns a
    :class:`TrainerPatch` (``undo()``, context manager)."""
    return TrainerPatch(detector_kwargs)
