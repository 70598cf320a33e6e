"""``check="step"``: the guard to leave on for a whole run. No module below the model's root has a
hook while the run is healthy, and no global module hook is registered; the root's two hooks and
one read per pass are what a healthy step costs:

- each forward of the root: its outputs (walked as ``containers=True`` walks them) in one engine
  call, one host read when it returns;
- each backward through the root's outputs: every parameter's gradient in one engine call when
  the backward ends (after DDP's and FSDP's own end-of-backward work), one host read, before
  ``backward()`` returns and so before any optimizer step. In a backward a ``GradScaler`` scaled,
  the scaler's own check is used instead: its ``found_inf``, right after its ``unscale_``, before
  its ``step`` would update anything.

At the first nan/inf the step is replayed (``replay.step``) with the full detector (``watch()``'s:
every module's frames, gradients, Where, Source, Op) watching every module, from what the guard
kept of it: each root call's inputs (references, version-checked), the RNG states at its start, its
grad mode and autocast, and the gradients that arrived at its outputs. The report is the full
detector's, then one ``Replay:`` line; what the detection does next is the ``on_detect``
strategy's, as in every mode. ``frames_every=N``: every Nth forward (and its backward) runs with
the full detector attached instead, for the flight recorder, the dashboards and ``warn_above``.

What it does not see: a nan/inf that reaches neither a root output nor a parameter's gradient (an
intermediate ``-inf`` mask, a value a later op drops, a gradient at an output that no path carries
to a parameter), and a backward that does not run through
the root's outputs (a loss made from a tensor taken out of the model by a hook of the user's).
"""

import functools
import sys
import threading
import weakref

import torch
from torch.compiler import is_compiling

from . import text
from .. import distributed
from ..replay.sandbox import call_state
from ..replay.step import REPRODUCED, KeptForward, replay_step, rng_now, root_outputs
from .errors import OverflowDetected, OverflowDetectedOnRanks, overflow_error, say
from .frames import BACKWARD, FORWARD, Frame, class_name, graph_task_id, recomputing
from .on_detect import strategy
from .rank_agreement import BACKWARD_END, FORWARD_END, REPLAYED, RankAgreement
from .scaling import Backoffs, backoff_line, entry_kind, scaled_backward
from .step_reads import SHOWN_GRADIENTS, Seen, StepReads
from .text import TENSOR


class StepGuard:
    """The pass state of ``check="step"`` and its hooks on the model's root: the detector's passes in
    this mode (the lock, ``strategy``, ``close``, ``waiting`` and ``flush_all`` it asks of them).
    ``watcher(module, batch, found, frames_step)``: a full detector attached to ``module`` for one
    step (a replay's, or with ``frames_step`` a frames step's, which leaves the root's hooks to
    this guard), whose batch counter starts at ``batch`` and which hands each detection it reports
    (an ``OverflowDetected``) to the list ``found``; the detector makes it."""

    def __init__(self, options, decisions, model, backend, watcher):
        self.options = options
        self.decisions = decisions
        self.model = model
        self.backend = backend
        self.watcher = watcher
        self.strategy = strategy(options.on_detect, model, options.max_skips)
        self.lock = threading.RLock()
        self.ranks = RankAgreement(options.sync, options.sync_timeout, self.strategy)
        self.scaled = ScaledSteps(self, options)  # backwards a GradScaler scaled: its own check decides them
        self.thread = threading.local()  # .calls: (exception being handled at its start, KeptForward) per root call
        self.through = []  # the forwards whose outputs the backward running now went through
        self.task = None  # the backward (graph task) whose end is queued
        self.full = None  # frames_every: [the full detector of this step, what it found, its backward to come]
        self.closed = False
        self.driven = False  # an integration calls begin() and end() (no root hook sees its calls)
        self.own_hooks = ()  # the ids of the detector's hooks on the root (a replay tells them from others')
        self.reading = StepReads(model, decisions, backend)  # what a healthy step reads

    # -- the root's hooks ----------------------------------------------------------------------

    def before(self, module, args, kwargs):
        if is_compiling() or graph_task_id() != -1 and recomputing():
            return  # traced (its end keeps the call), or activation checkpointing's recompute in a backward
        calls = self._calls()
        ambient = sys.exception()
        if calls:
            calls.append((ambient, None))  # the root called inside its own forward
            return
        with self.lock:
            self._forward_begins()
            if self.full is not None:
                self.full[0]._passes.call_starts(module, args, kwargs, depth=2)
                calls.append((ambient, None))
                return
        calls.append((ambient, KeptForward(args, kwargs or {}, rng_now(), call_state(),
                                           self.decisions.state.batch_number)))

    def after(self, module, args, kwargs, output):
        if is_compiling() or graph_task_id() != -1 and recomputing():
            return
        calls = self._calls()
        ambient, kept = calls.pop() if calls else (None, None)
        if calls:
            return  # the outermost call decides
        error = sys.exception()
        raised = error is not None and error is not ambient  # run by torch because the forward raised
        with self.lock:
            if self.full is not None:
                self._full_forward_ends(output, raised, lambda: self.full[0]._after_model(module, args, kwargs,
                                                                                         output))
                return
            batch = self.decisions.state.count(True).batch_before
            if raised:
                return
            if kept is None:  # a compiled root: its start was traced
                kept = KeptForward(args, kwargs or {}, None, call_state(), batch)
            self._forward_ends(kept, output, batch)

    # -- a root call an integration drives ------------------------------------------------------

    def begin(self, call, args, kwargs=None):
        """A root call begins that no hook sees (a LightningModule's ``training_step``, which runs
        the model's parts but never its forward): the integration says so instead of the root's
        pre hook. ``call(*args, **kwargs)`` is what a replay runs. Its batch number is not counted
        (the model's forward never runs: the frames of ``watch()`` count none either)."""
        with self.lock:
            self.driven = True
            self._forward_begins()
            batch = self.decisions.state.batch_number
            kept = None if self.full is not None else KeptForward(args, kwargs or {}, rng_now(), call_state(), batch,
                                                                  call)
            self._calls()[:] = [(None, kept)]

    def end(self, output):
        """That call's output (the loss its backward runs from), before the backward: as the root's
        post hook."""
        calls = self._calls()
        _, kept = calls.pop() if calls else (None, None)
        with self.lock:
            if self.full is not None:
                self._full_forward_ends(output, False, lambda: None)
            elif kept is not None:
                self._forward_ends(kept, output, kept.batch)

    def _calls(self):
        calls = getattr(self.thread, "calls", None)
        if calls is None:
            calls = self.thread.calls = []
        return calls

    def _forward_begins(self):
        if self.full is not None and self.full[2]:  # its backward never came: the full step is over
            self._detach_full()
        every = self.options.frames_every
        batch = self.decisions.state.batch_number
        if self.full is None and every is not None and self.decisions.step_of(batch) % every == 0:
            found = []
            self.full = [self.watcher(self.model, batch, found, not self.driven), found, False]

    # -- a forward's end -------------------------------------------------------------------------

    def _forward_ends(self, kept, output, batch):
        outputs = root_outputs(output)
        if self.reading.outputs_nonfinite(outputs):
            seen = self.reading.outputs_seen(output)
            if seen is not None:
                self._pass_ends(FORWARD_END, self._detected(seen, batch, [kept], backward=False,
                                                            run_outputs=outputs))
                return
        self._pass_ends(FORWARD_END)
        if kept.call["grad_enabled"] and self.options.backward:
            self._watch_gradients(kept, outputs)

    def _watch_gradients(self, kept, outputs):
        """Hook the gradients arriving at a forward's outputs (``root_outputs``): each is kept for a
        replay of the backward, and the first queues the backward's end. (Nothing else keeps the
        forward: the hooks on its outputs do, as long as the outputs live.)"""
        guard = weakref.ref(self)  # a removed guard's hooks on live outputs keep nothing alive
        for index, tensor in enumerate(outputs):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(_gradient_arrived, guard, kept, index))

    def gradient_arrived(self, kept, index, grad):
        with self.lock:
            kept.keep_gradient(index, grad)
            if kept not in self.through:
                self.through.append(kept)
            task = graph_task_id()
            if self.task != task:
                self.task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._queue_backward_end)

    def _queue_backward_end(self):
        # queued again: after the callbacks queued while the backward ran (DDP's reduction, FSDP's)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    # -- a backward's end --------------------------------------------------------------------------

    def _backward_ends(self):
        try:
            self._decide_backward()
        except OverflowDetected as error:
            raise error.with_traceback(None)  # (the report's traceback starts here: the frames below help no reader)

    def _decide_backward(self):
        with self.lock:
            task, self.task = self.task, None
            through, self.through = self.through, []
            if self.closed:
                return
            if self.full is not None:
                self._full_backward_ends()
                return
            batch = min(kept.batch for kept in through) if through else self.decisions.state.forward_batch
            scaled = scaled_backward(task)
            if scaled is not None:  # the scaler reads these gradients: its verdict comes with its unscale_
                self.scaled.add(scaled, through, batch)
                self._pass_ends(BACKWARD_END)
                return
            seen = self.reading.gradients()
            self._pass_ends(BACKWARD_END, None if seen is None else self._detected(seen, batch, through, backward=True))

    # -- a detection ----------------------------------------------------------------------------

    def _detected(self, seen, batch, forwards, backward, run_outputs=None, scaler=None):
        """A nan/inf reached a root output or a parameter's gradient: replay the step (with a
        ``scaler``, each of ``forwards`` lists in turn until one reproduces it) with the full
        detector, which reports it; else report what the guard saw. Returns what ``_pass_ends``
        takes: (detection, frames, the replay, phase)."""
        for attempt in forwards if scaler is not None else [forwards]:
            found = []
            replayed = replay_step(self.model, attempt, _replay_watcher(self, batch, found), backward, run_outputs,
                                   self.own_hooks)
            if replayed.outcome == REPRODUCED:
                break
        if found:
            detection, frames = dict(found[0].detection), found[0].frames
        else:
            detection, frames = _own_report(seen, batch, self.strategy, self.decisions)
        if scaler is not None:
            detection["scaler"] = scaler
            if self.strategy.reports != "none":
                say(f"GradScaler: {scaler['why']}")
        return detection, frames, replayed, seen.frame.phase

    def _pass_ends(self, kind, detected=None):
        """A pass ended (the root's forward returned, a backward ended): with ``detected`` (this
        rank's, from ``_detected``; a frames step's, its replay None) the Replay line, the record and
        what the strategy does. Under torch.distributed every rank agrees first which ranks detected
        and, if any did, whose replay reproduced it; all raise together."""
        agreed = self.ranks.wanted()
        ranks = reproduced_on = None
        replayed = detected[2] if detected is not None else None
        if agreed:
            ranks = self.ranks.ranks(detected is not None or self.strategy.skipping(), kind)
            if ranks:
                reproduced_on = self.ranks.ranks(replayed is not None and replayed.outcome == REPRODUCED, REPLAYED)
        stop = None
        if detected is not None:
            detection, frames, _, phase = detected
            detection["check"] = "step"
            if replayed is not None:
                if self.strategy.reports != "none":
                    say(replayed.line(reproduced_on, ranks=agreed))
                detection["replay"] = replayed.record()
                detection["transient"] = False if reproduced_on else replayed.transient
            self.decisions.detections.append(detection)
            if self.decisions.log is not None:
                self.decisions.log.detection(detection)
            if self.strategy.stops():
                stop = (detection, frames)
            else:
                self.strategy.went_on(detection, frames, _FirstFrame(detection, phase), detection.get("entries", []),
                                      True)
        if ranks and (stop or not self.strategy.ranks_detected()):
            self.decisions.state.set_detected_overflow(True)
            raise OverflowDetectedOnRanks(ranks, distributed.world()[1], *(stop or ()))
        if stop is not None:
            raise overflow_error(*stop)

    # -- frames_every: a step with the full detector attached -----------------------------------------

    def _full_forward_ends(self, output, raised, root_ends):
        """A frames step's forward ended: ``root_ends()`` runs the full detector's root hook."""
        watching, found, _ = self.full
        try:
            root_ends()
        except BaseException:
            self._detach_full()
            raise
        finally:
            self.decisions.state.batch_number = watching.decisions.state.batch_number
            self.decisions.state.forward_batch = watching.decisions.state.forward_batch
        if raised:
            self._detach_full()
        elif found:
            self._full_found(FORWARD)
        elif torch.is_grad_enabled() and any(t.requires_grad for t in root_outputs(output)):
            self._pass_ends(FORWARD_END)
            self.full[2] = True  # its backward is watched too
            self._watch_gradients(KeptForward((), {}, None, call_state(), self.decisions.state.forward_batch),
                                  root_outputs(output))
        else:
            self._detach_full()
            self._pass_ends(FORWARD_END)

    def _full_backward_ends(self):
        if self.full[1]:
            self._full_found(BACKWARD)
            return
        self._detach_full()
        self._pass_ends(BACKWARD_END)

    def _full_found(self, phase):
        found = self.full[1]
        self._detach_full()
        self._pass_ends(BACKWARD_END if phase == BACKWARD else FORWARD_END,
                        (dict(found[0].detection), found[0].frames, None, phase))

    def _detach_full(self):
        if self.full is not None:
            watching, self.full = self.full[0], None
            watching.remove()

    # -- what the detector asks of its passes -------------------------------------------------------

    def waiting(self):
        return bool(self._calls()) or self.task is not None

    def flush_all(self):
        pass  # nothing waits: each pass is decided when it ends

    def close(self):
        self.closed = True
        self.strategy.close()
        self.scaled.close()
        self.thread = threading.local()
        self.through = []
        self._detach_full()
        self.model = self.reading = None  # a removed detector keeps none of the model


class ScaledSteps:
    """Under a ``GradScaler``: the backwards it scaled since its last update, whose gradients the
    guard does not read (the scaler reads them in its ``unscale_`` and tells ``scaling``'s listeners
    what it found): a backoff it recovers from is one line, one it cannot a detection, replayed
    from the first micro-batch whose replay reproduces it (``scaling.Backoffs``)."""

    def __init__(self, guard, options):
        self.guard = guard
        self.pending = []  # (ScaledBackward, its forwards, batch) since their scaler's last update
        self.backoffs = Backoffs(options.min_loss_scale, options.max_backoffs, owner=self)

    def add(self, scaled, forwards, batch):
        self.pending.append((scaled, forwards, batch))

    def unscaled(self, scaler, found_inf):
        """A scaler unscaled an optimizer's gradients and found ``found_inf`` (``scaling``)."""
        guard = self.guard
        with guard.lock:
            pending = [entry for entry in self.pending if entry[0].scaler() is scaler]
            if not pending or not found_inf:
                return
            # the unscaled gradients, read once: where the scaler's nan/inf is, and what it is
            seen = guard.reading.gradients() or Seen(_empty_frame(guard.model), [])
            first = ("", seen.bad[0], entry_kind(seen.frame, seen.bad[:1])) if seen.bad else None
            verdicts = [self.backoffs.judge(scaled, first) for scaled, _, _ in pending]
            batch = pending[-1][2]
            fatal = next((verdict for verdict, _ in verdicts if verdict is not None and verdict.why is not None), None)
            if fatal is None:
                last = next((verdict for verdict, _ in reversed(verdicts) if verdict is not None), None)
                if last is not None and any(first for _, first in verdicts):
                    self._backoff(last, batch, seen)
                return
            self.pending = [entry for entry in self.pending if entry not in pending]
            guard._pass_ends(BACKWARD_END, guard._detected(
                seen, batch, [forwards for _, forwards, _ in pending], backward=True,
                scaler={"scale": fatal.scale, "in_a_row": fatal.in_a_row, "why": fatal.why}))

    def updated(self, scaler):
        """A scaler moved to its next step: its unscale_ judged what this step's backwards held."""
        with self.guard.lock:
            self.pending = [entry for entry in self.pending if entry[0].scaler() not in (scaler, None)]

    def _backoff(self, verdict, batch, seen):
        """A backoff's line and record, saying where (``seen``: the gradients' read)."""
        decisions, entries = self.guard.decisions, seen.bad
        name, cls = "", class_name(self.guard.model)
        say(backoff_line(name, cls, entries[:3] + (["..."] if len(entries) > 3 else []), verdict, batch,
                         decisions.global_step, entry_kind(seen.frame, entries) if entries else "inf/nan"))
        if decisions.log is not None:
            decisions.log.backoff({"batch_number": batch, "module": name, "class": cls, "entries": entries,
                                   "scale": verdict.scale, "in_a_row": verdict.in_a_row,
                                   "global_step": decisions.global_step, "mode": decisions.mode})

    def close(self):
        self.pending = []
        self.backoffs.close()


def _replay_watcher(guard, batch, found):
    """What ``replay_step`` attaches: the guard's full detector, printing what the strategy prints."""
    def watch(module):
        watching = guard.watcher(module, batch, found, False)
        watching.decisions.counting.reports = guard.strategy.reports
        return watching
    return watch


def _own_report(seen, batch, strategy, decisions):
    """What a guard saw, where its replay reported nothing: the reference's lines of the entries
    that count, then the frame of what it read; and the detection as data, with its frames."""
    frame, bad = seen
    backward = frame.phase == BACKWARD
    if strategy.reports != "none":
        rows = {ctx: frame.rows[payload] for kind, ctx, payload in frame.entries if kind == TENSOR}
        for ctx in bad[:SHOWN_GRADIENTS]:
            for line in text.overflow_lines(rows[ctx], ctx) if ctx in rows else []:
                say(line)
        if len(bad) > SHOWN_GRADIENTS:
            say(f"... and {len(bad) - SHOWN_GRADIENTS} more gradients hold a nan/inf")
        say(text.dump_text(batch, [frame], f"the backward of batch_number={batch}" if backward else None, backward))
    detection = {"batch_number": batch, "phase": frame.phase, "module": "", "class": frame.class_name,
                 "entries": list(bad)}
    if decisions.global_step is not None:
        detection["global_step"] = decisions.global_step
    if decisions.mode is not None:
        detection["mode"] = decisions.mode
    return detection, [text.frame_data(frame)]


class StepMode:
    """What the detector does in check="step" beyond its other modes (a base of the detector, which
    has ``options``, ``model``, ``module_names``, ``decisions``, ``_handles`` and ``_passes``, the
    guard): the root's two hooks, a full detector for one step (``_watcher``), and the guard driven
    by an integration instead (``_driven``)."""

    def _register_step_hooks(self):
        # no hook below the root: its own two, which run even when its call raises
        self._handles.append(self.model.register_forward_pre_hook(self._step_begins, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._step_ends, with_kwargs=True, always_call=True))
        self._passes.own_hooks = frozenset(handle.id for handle in self._handles)

    def _step_begins(self, module, args, kwargs):
        self._passes.before(module, args, kwargs)

    def _step_ends(self, module, args, kwargs, output):
        try:
            self._passes.after(module, args, kwargs, output)
        except OverflowDetected as error:
            raise error.with_traceback(None)  # (the report's traceback starts here: the frames below help no reader)

    def _watcher(self, module, batch, found, frames_step):
        """check="step": the full detector (``watch()``'s frames, gradients, Where, Source and Op)
        attached to ``module`` for one step, its batch counter at ``batch``, each detection it
        reports handed to ``found``. ``frames_step``: a step of ``frames_every``, on the run itself
        (its root's hooks are the guard's, its records go into this detector's log, its early
        warnings are this detector's); else a replay's (see ``replay.step``)."""
        options = self.options.changed(
            check="batch", frames_every=None, kwargs=True, containers=True, backward=True, find_op=True,
            sync=False, log=None, trace_batch_nums=None, abort_after_batch_num=None, on_detect=found.append,
            warn_above=self.options.warn_above if frames_step else None)
        watching = type(self).__new__(type(self))
        watching._attach(module, options, self.module_names, self if frames_step else None)
        decisions = watching.decisions
        decisions.state.batch_number = decisions.state.forward_batch = batch
        decisions.global_step, decisions.mode, decisions.samples = (self.decisions.global_step, self.decisions.mode,
                                                                    self.decisions.samples)
        if frames_step:
            decisions.log = None if self.decisions.log is None else _Lent(self.decisions.log)
            decisions.early_warnings = self.decisions.early_warnings
        return watching

    def _driven(self):
        """check="step" driven by an integration (``StepGuard.begin`` and ``end``) instead of the
        root's hooks, which come off: a LightningModule's steps run its parts, never its forward.
        Returns the guard."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._passes.driven = True
        return self._passes


class _Lent:
    """A log lent to a frames step's full detector: it writes into it, and leaves it open."""

    __slots__ = ("log",)

    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):
        return getattr(self.log, name)

    def close(self):
        pass


def _gradient_arrived(guard, kept, index, grad):
    """A gradient arrived at a root output; ``guard`` held weakly."""
    guard = guard()
    if guard is not None and not guard.closed:
        guard.gradient_arrived(kept, index, grad)
    # returns None: the gradient flows on unchanged


def _empty_frame(model):
    frame = Frame("", class_name(model), [], [], BACKWARD)
    frame.rows = []
    return frame


class _FirstFrame:
    """What a strategy's ``went_on`` reads of a detection's first frame: its module and phase."""

    __slots__ = ("module_name", "phase")

    def __init__(self, detection, phase):
        self.module_name = detection.get("module", "")
        self.phase = phase
