"""Passes: the unit whose calls are read and decided together, and what a detector holds while it runs.

- A forward pass: the outermost hooked call on one thread, until it returns. Each thread has its
  own, with its own rows, so threads driving one model never decide, or reset, each other's calls.
- The backward pass: every call made while autograd runs a backward (gradient frames, and the
  forwards that activation checkpointing recomputes), decided when that backward ends, before
  ``backward()`` returns and so before any optimizer step.

A pass's calls wait in its queue with their rows (``reads``); ``flush`` brings the rows to the
host and has ``decisions`` replay the calls; a detection then goes to the strategy (``on_detect``).
The end of a pass is one function for both kinds: flush, free the rows, agree with the other ranks.

A pass can also be abandoned: torch runs ``always_call`` forward hooks only for an ``Exception``,
so a ``KeyboardInterrupt``, ``SystemExit`` or other ``BaseException`` raised inside a forward
leaves its hooked calls running forever on paper; and autograd runs the callbacks queued for a
backward's end only when it succeeds. Such a pass ends at the next forward's first hook (``abandon_*``):
its calls are decided (a nan/inf among them is reported, never raised, and acted on by no
strategy), nothing of it is kept, and the next forward is checked afresh. Noticing it costs the
hot path two identity tests: a forward's calls are abandoned when its outermost module (or the
model) is called again while the frame that called it is no longer running.

``Passes`` is made fresh for a detector and for each copy or pickle of it: it holds the lock,
device buffers, waiting calls and the strategy's state, none of which a copy may share.
"""

import itertools
import sys
import threading
import warnings

import torch

from . import culprit, source, where
from .. import distributed
from .compiled import Traced
from .decisions import NO_ROWS, Pending
from .errors import OverflowDetected, OverflowDetectedOnRanks, overflow_error, say
from .frames import BACKWARD, FORWARD, graph_task_id
from .on_detect import strategy
from .reads import Reads, may_wait
from .scaling import Backoffs

try:  # how non-reentrant activation checkpointing stops a recompute early: control flow, not an error
    from torch.utils.checkpoint import _StopRecomputationError as _STOP_RECOMPUTATION
except ImportError:
    _STOP_RECOMPUTATION = ()


class Pass:
    """The calls of one pass waiting for their decision, and the rows that hold their statistics."""

    __slots__ = ("reads", "queue", "serial", "stop_pending", "deciding", "abandoned", "task", "scaling")

    def __init__(self, reads, serial):
        self.reads = reads  # None once the pass is closed
        self.queue = []  # Pending calls, in hook order
        self.serial = serial  # None for the backward pass
        self.stop_pending = None  # (detection, frames): this rank detected; the error waits for the agreement
        self.deciding = False  # the pass is ending: a detection now waits for its agreement
        self.abandoned = False  # its calls never returned: it ends at the next forward (see the module)
        self.task = -1  # a backward pass: the graph task whose end was to decide it
        self.scaling = None  # a backward pass: its GradScaler's (scaling.Scaling), for the graph task it names

    def key(self, batch):
        """Which pass a detection belongs to (later frames of the same pass only pass the values on)."""
        return ("forward", self.serial) if self.serial is not None else ("backward", batch)


class _ThreadState(threading.local):
    """Per thread: the hooked calls running (each with the exception being handled when it started:
    a post hook that sees another one runs because the call raised), the frame that runs the
    outermost of them (its hook's caller, torch's, on the stack until that call ends) and the
    forward pass."""

    def __init__(self):
        self.calls = []
        self.outer = None
        self.forward = None


class _Abandoned(BaseException):
    """The error a pass ends with when its calls never returned (never raised)."""


def on_stack(frame):
    """Whether ``frame`` is running on this thread now (its frames are walked: call it rarely)."""
    current = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


class Passes:
    def __init__(self, detector):
        options = detector.options
        self.options = options
        self.decisions = detector.decisions
        self.sync_timeout = options.sync_timeout
        self.strategy = strategy(options.on_detect, detector.model, options.max_skips)
        self.lock = threading.RLock()  # hooks may run on several threads
        self.thread = _ThreadState()
        self.backward = None  # the backward pass, while it has calls
        self.open = []  # every pass with calls (close() decides them)
        self.idle_reads = []  # rows of ended passes, reused by the next ones
        self.serials = itertools.count()
        self.new_reads = lambda: Reads(detector.backend, options.buffer_rows, options.reuse_stats, options.stage_bytes)
        self.apart = None  # the Reads of calls read on their own (create_frame)
        self.traced = Traced()  # hooks traced by torch.compile, replayed by the next eager hook
        # the last clean pass's calls, freed when the next pass begins (not between a forward's
        # read and its backward: on a GPU the device would idle that long)
        self.spent = None
        self.flush_task = None  # the backward (graph task) whose end will decide the backward pass
        self.agreement = None  # with the other ranks (made when first needed, if not at construction)
        self.agreements = 0  # agreement points reached: their sequence numbers
        # find_op: the last forward's calls (autograd on) and the gradients arriving at their
        # outputs (by the output tensor's id), kept until its backward pass ends
        self.kept_forward = []
        self.kept_gradients = {}
        self.autocast = {}  # find_op: the autocast the current forward runs under
        self.collective_writes = None  # held from the first pass under torch.distributed
        # whether the gradient arriving at a module's outputs is read (the Source line's claim)
        self.incoming_read = lambda module: detector._gradients is None or detector._gradients.incoming_read(module)
        # gradient checks: which backwards a GradScaler scaled, and when its backoff is a detection
        self.backoffs = Backoffs(options.min_loss_scale, options.max_backoffs) if options.backward else None
        if self.sync_wanted():
            # collective: every rank builds its detector here; a rank alone fails here, in time
            self.agreement = distributed.Agreement(timeout=self.sync_timeout)

    # -- which pass ------------------------------------------------------------------------------

    def _open_pass(self, serial):
        if self.collective_writes is None:
            # in-place collectives bump the version counters of what they write (once a process
            # group exists), so that a row read before such a write is never reused after it
            self.collective_writes = distributed.seen_as_writes()
        reads = self.idle_reads.pop() if self.idle_reads else self.new_reads()
        opened = Pass(reads, serial)
        self.open.append(opened)
        return opened

    def forward_pass(self):
        """This thread's forward pass (opened by its first call)."""
        current = self.thread.forward
        if current is None or current.reads is None:
            current = self.thread.forward = self._open_pass(next(self.serials))
        return current

    def backward_pass(self):
        if self.backward is None:
            self.backward = self._open_pass(None)
        return self.backward

    def _close(self, ended):
        """Free an ended pass's rows (after its calls were replayed)."""
        if ended.reads is None:
            return
        ended.reads.reset()
        if ended in self.open:
            self.open.remove(ended)
            self.idle_reads.append(ended.reads)
        ended.reads = None  # closed: a thread that still holds it opens a new one
        if self.thread.forward is ended:
            self.thread.forward = None
        if self.backward is ended:
            self.backward = None

    # -- calls -----------------------------------------------------------------------------------

    def decides_now(self, call):
        """Whether a call is decided at once: with check="module", in a traced batch, after a detection."""
        return self.options.check == "module" or call.trace_mode or self.decisions.state.detected_overflow

    def add(self, current, call, module, entries, dtypes, tensors, phase, consumers=None, inputs=None):
        """Read a call's tensors (or let them wait, see ``reads``) and queue the call; decide now
        with check="module", in a traced batch and after a detection."""
        now = self.decides_now(call)
        if not tensors:
            sources = NO_ROWS
        else:
            reads = current.reads
            defer = self.options.defer and self.options.check == "batch" and not now
            site = id(module) if may_wait(defer, phase, call.trace_mode, tensors) else -1
            sources = reads.add(tensors, site)
            if sources is None:  # the buffer is full: what waits is decided now
                self.flush(current)
                reads.reset()
                sources = reads.add(tensors, site)
        # decided now: its tensors stay referenced until then, for a detection's Where line
        self.queue(current, Pending(call, module, entries, dtypes, sources, phase, consumers, inputs,
                                    tensors if now else None), now)

    def queue(self, current, pending, now=False):
        current.queue.append(pending)
        if now or len(current.queue) >= self.options.buffer_rows:
            self.flush(current)

    def flush(self, current):
        """Read a pass's pending statistics (one host read per device) and replay its calls in
        order; raises the reference's ValueError at the first that holds a nan/inf (with "raise")."""
        queue, current.queue = current.queue, []
        if not queue:
            return
        nonfinite = current.reads.read()
        decisions = self.decisions
        if not nonfinite and decisions.quiet(queue):
            decisions.replay_finite(current.reads, queue)
            # a call decided in its hook holds its tensors (for a Where line): let them go now
            self.spent = queue if queue[-1].tensors is None else None
            return
        scaling = self._scaling(current)
        for pending in queue:
            if current.stop_pending:
                break  # this rank reported; the calls after the detection never happened
            found = decisions.replay(current.key, current.reads, pending, scaling)
            if found is not None:
                self._act(current, found)  # raises at the first bad call: those after it never happened
                if current.abandoned:
                    break

    def _scaling(self, current):
        """The GradScaler's view of a backward pass (``scaling.Scaling``) or None: not scaled, not a
        backward, no gradient checks. Asked of the graph task running now (check="module" decides
        inside the backward), else of the one the pass was to end with."""
        if self.backoffs is None or current.serial is not None:
            return None
        task = graph_task_id()
        if task == -1:
            task = current.task
        if current.scaling is None or current.scaling.task != task:
            current.scaling = self.backoffs.scaling(task)
        return current.scaling

    def flush_all(self):
        for pending in list(self.open):
            self.flush(pending)

    def _act(self, current, found):
        """What the strategy does with a detection the replay found."""
        decisions = self.decisions
        frame = found.first_frame
        if frame.phase == BACKWARD and found.bad and not any(ctx.startswith("output") for ctx in found.bad):
            frame.incoming_read = self.incoming_read(decisions.modules_by_name().get(frame.module_name))
        if found.bad:  # where in the tensor the Source line names
            found.detection["where"] = where.facts(
                found.first_frame, source.source_entry(found.first_frame, found.bad),
                where.Held(found.tensors, found.inputs, self.kept_forward, self.kept_gradients,
                           decisions.modules_by_name(), self.options.kwargs, self.options.containers,
                           decisions.samples))
        scaler = current.scaling.unrecoverable() if current.scaling is not None else None
        if scaler is not None and found.first_frame.phase == BACKWARD:
            found.detection["scaler"] = scaler  # a GradScaler's backward that no backoff recovers
        if self.options.keeps_calls:
            self._explain(found)
        decisions.log_detection(found)
        if current.abandoned:  # reported, and the next forward is checked afresh
            decisions.dump(found)
            decisions.state.detected_overflow = False
            say("overflow_fast: that report is of a pass that an exception interrupted before its end (a "
                "KeyboardInterrupt in a forward, any exception in a backward); it stops nothing, and what "
                "runs next is checked afresh")
            return
        if self.strategy.stops():
            decisions.dump(found)
            if self.sync_wanted() and (self.thread.calls or current.deciding or graph_task_id() != -1):
                # the other ranks are mid-pass, inside their own collectives (DDP, FSDP2, tensor
                # parallel): stop with them when this pass ends, not here
                current.stop_pending = (found.detection, found.frames)
                return
            raise overflow_error(found.detection, found.frames)
        decisions.state.detected_overflow = False  # go on: later batches are checked afresh
        if found.report_due:
            decisions.dump(found)
        self.strategy.went_on(found.detection, found.frames, found.first_frame, found.bad, found.report_due)
        decisions.state.frames.clear()

    def _explain(self, found):
        """find_op: the op and the line that made the detection's first nan/inf (its replay), and
        whether it is transient, into the detection; repro: the reproducer file of that call.
        Never fails the run it explains."""
        try:
            explained = culprit.op_of(found, self.kept_forward, self.kept_gradients,
                                        self.decisions.modules_by_name())
        except Exception as error:  # noqa: BLE001 - a replay must never break training
            explained = culprit.failed(found.first_frame.phase, error)
        if explained is None:
            return
        if self.options.find_op:
            found.detection["op"] = explained.record()
            found.detection["transient"] = explained.transient
        if self.options.repro is not None and explained.call is not None:
            from .op_replay import ReproError

            try:
                found.detection["repro"] = explained.write_repro(
                    self.options.repro, distributed.rank(), self.decisions.step_of(found.batch), found.detection)
            except ReproError as error:
                warnings.warn(f"overflow_fast: {error}", RuntimeWarning, stacklevel=2)

    # -- the end of a pass -------------------------------------------------------------------------

    def end(self, ended, phase, error=None):
        """A pass ended (its outermost call returned or raised ``error``; its backward finished):
        decide on its calls, free its rows, then (under torch.distributed) agree with the other ranks."""
        ended.deciding = True
        try:
            if isinstance(error, OverflowDetected):
                ended.queue = []  # reported already, here or by another detector on this model
            else:
                try:
                    self.flush(ended)
                except ValueError:
                    if error is None or isinstance(error, _STOP_RECOMPUTATION):
                        raise
                    # torch silences (with a warning) what a hook raises here: annotate its error
                    if hasattr(error, "add_note"):
                        error.add_note("overflow_fast: an inf/nan was detected earlier in this forward; "
                                       "its report is printed above")
        finally:
            ended.deciding = False
            self._close(ended)
            if self.sync_wanted() and not ended.abandoned:  # the other ranks are elsewhere by now
                self._agree(ended, phase)

    def abandon_forward(self):
        """This thread's hooked calls never returned (see the module): their pass ends now."""
        thread = self.thread
        del thread.calls[:]  # (the pre hook holds this list)
        thread.outer = None
        abandoned = thread.forward
        if abandoned is not None and abandoned.reads is not None:
            abandoned.abandoned = True
            self.end(abandoned, FORWARD, _Abandoned())

    def abandon_backward(self):
        """The backward whose end was to decide the backward pass failed (see the module): the pass
        ends now, and what find_op kept for its replay goes."""
        task, self.flush_task = self.flush_task, None
        try:
            abandoned = self.backward
            if abandoned is not None and abandoned.reads is not None:
                abandoned.abandoned = True
                abandoned.task = task
                self.end(abandoned, BACKWARD, _Abandoned())
        finally:
            self._let_go_of_the_forward()

    def decide_when_backward_ends(self):
        """Decide the backward pass when this backward ends, before ``backward()`` returns and so
        before the optimizer step."""
        if not (self.options.check == "batch" or self.options.keeps_calls or self.sync_wanted()):
            return
        task = graph_task_id()
        if self.flush_task == task:
            return
        self.flush_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self):
        with self.lock:
            self.flush_task = None
            try:
                self.end(self.backward_pass(), BACKWARD)
            finally:
                self._let_go_of_the_forward()

    def _let_go_of_the_forward(self):
        """find_op: the backward that the last forward's calls were kept for ended. Autograd lets go
        of their activations now; so do they (a pass's finished calls wait until the next begins)."""
        for inputs in self.kept_forward:
            inputs.release()
        self.kept_forward = []
        self.kept_gradients = {}

    def sync_wanted(self):
        """Whether this detector's decisions are agreed between ranks (see overflow_fast.distributed)."""
        return (self.options.sync and self.strategy.agreed and distributed.world() is not None
                and not distributed.is_local_only())

    def _agree(self, ended, phase):
        """One small collective on a process group of its own: every rank learns which ranks
        detected; all raise together (with on_detect="skip": all skip the step together). Its
        sequence number counts the agreement points and tells a forward's from a backward's, so
        ranks that meet at different points (uneven forwards, a backward one rank skipped after
        its forward raised) get an error naming them, never a decision."""
        pending, ended.stop_pending = ended.stop_pending, None
        if self.agreement is None:
            self.agreement = distributed.Agreement(timeout=self.sync_timeout)
        self.agreements += 1
        seq = 2 * self.agreements + (phase == BACKWARD)
        ranks = self.agreement.agree(bool(pending) or self.strategy.skipping(), seq=seq)
        if ranks and (pending or not self.strategy.ranks_detected()):
            self.decisions.state.detected_overflow = True
            raise OverflowDetectedOnRanks(ranks, distributed.world()[1], *(pending or ()))

    def close(self):
        """The hooks are off: decide what waits (its records and detection still reach the log),
        free every row, let go of the strategy's own hooks."""
        self.strategy.close()
        if self.collective_writes is not None:
            self.collective_writes.release()
            self.collective_writes = None
        if self.backoffs is not None:
            self.backoffs.close()
        self.thread = _ThreadState()  # calls running now will never end a pass
        try:
            self.flush_all()
        finally:
            for pending in list(self.open):
                self._close(pending)
            self.spent = None

