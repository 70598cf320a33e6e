"""How a pass ends (``passes``): its calls decided (``flush``: the rows brought to the host, the
calls replayed) and a detection acted on, its rows freed, the ranks agreed, and a pass that never
ends on its own (a ``KeyboardInterrupt`` in a forward, an exception in a backward: see ``passes``)
abandoned at the next forward's first hook. A base of ``Passes``, whose state it uses."""

import enum
import itertools
import weakref

import torch

from . import explain
from .errors import OverflowDetected, overflow_error, say
from .frames import BACKWARD, FORWARD, graph_task_id
from .rank_agreement import BACKWARD_END, FORWARD_END

try:  # how non-reentrant activation checkpointing stops a recompute early: control flow, not an error
    from torch.utils.checkpoint import _StopRecomputationError as _STOP_RECOMPUTATION
except ImportError:
    _STOP_RECOMPUTATION = ()


# Every live detector's passes, by the order they were made. On a module that two detectors watch
# (one on a model, one on its block), torch runs the hooks of the one made first first: with the
# reference, and with check="module", that one reports a nan/inf there first. A later one about to
# report (its pass ended sooner: the block's) lets the earlier ones decide first (``flush``).
_made = itertools.count()
_live = weakref.WeakValueDictionary()  # when made -> Passes


class PassState(enum.Enum):
    """Where a pass is. RUNNING, then ENDING, then CLOSED; STOPPING from RUNNING or ENDING;
    ABANDONED from RUNNING or STOPPING; every pass ends CLOSED."""

    RUNNING = "running"  # its calls are read and queued as they return
    ENDING = "ending"  # its end decides its calls: a detection now waits for the agreement
    STOPPING = "stopping"  # this rank detected: later calls never happened; the error waits for the agreement
    ABANDONED = "abandoned"  # its calls never returned (see the module): its end stops nothing
    CLOSED = "closed"  # decided, its rows freed: a thread that still holds it opens a new one


class _Abandoned(BaseException):
    """The error a pass ends with when its calls never returned (never raised)."""


class PassEnds:
    """The end of the detector's passes (its ``Passes``)."""

    # -- the end of a pass -------------------------------------------------------------------------

    def _live_from_now(self):
        """This detector's passes among the live ones (``_earlier_detectors_decide``); returns when
        they were made."""
        made = next(_made)
        _live[made] = self
        return made

    def _live_no_more(self):
        _live.pop(self.made, None)

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
        if nonfinite and len(_live) > 1:
            try:
                _earlier_detectors_decide(self)
            except BaseException:
                current.queue[:0] = queue  # (its end finds them reported, or decides them)
                raise
        scaling = self._scaling(current)
        for pending in queue:
            if current.stopping:
                break  # this rank reported; the calls after the detection never happened
            found = decisions.replay(current.key, current.reads, pending, scaling)
            if found is not None:
                self._act(current, found)  # raises at the first bad call: those after it never happened
                if current.state is PassState.ABANDONED:
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
        for open_pass in list(self.open):
            self.flush(open_pass)

    def end(self, ended, phase, error=None):
        """A pass ended (its outermost call returned or raised ``error``; its backward finished):
        decide on its calls, free its rows, then (under torch.distributed) agree with the other ranks."""
        ended.begin_ending()
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
            abandoned = ended.state is PassState.ABANDONED
            stop = self._close(ended)
            if self.sync_wanted() and not abandoned:  # the other ranks are elsewhere by now
                self._agree(stop, phase)

    def abandon_forward(self):
        """This thread's hooked calls never returned (see the module): their pass ends now."""
        thread = self.thread
        del thread.calls[:]  # (the pre hook holds this list)
        thread.outer = None
        abandoned = thread.forward
        if abandoned is not None and abandoned.state is not PassState.CLOSED:
            abandoned.abandon()
            self.end(abandoned, FORWARD, _Abandoned())

    def abandon_backward(self):
        """The backward whose end was to decide the backward pass failed (see the module): the pass
        ends now, and what find_op kept for its replay goes."""
        task, self.flush_task = self.flush_task, None
        try:
            abandoned = self.backward
            if abandoned is not None and abandoned.state is not PassState.CLOSED:
                abandoned.abandon()
                abandoned.task = task
                self.end(abandoned, BACKWARD, _Abandoned())
        finally:
            self._let_go_of_the_forward()

    def decide_when_backward_ends(self):
        """Decide the backward pass when this backward ends, before ``backward()`` returns and so
        before the optimizer step."""
        if not (not self.decides_each_call or self.keeps_calls or self.sync_wanted()):
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
            except OverflowDetected as error:
                raise error.with_traceback(None)  # (the report's traceback starts here: the frames below help no reader)
            finally:
                self._let_go_of_the_forward()

    def _let_go_of_the_forward(self):
        """find_op: the backward that the last forward's calls were kept for ended. Autograd lets go
        of their activations now; so do they (a pass's finished calls wait until the next begins)."""
        for kept_call in self.kept_forward:
            kept_call.release()
        self.kept_forward = []
        self.kept_gradients = {}

    def _act(self, current, found):
        """What the strategy does with a detection the replay found."""
        decisions = self.decisions
        found = explain.beyond_the_reference(self, current, found)
        decisions.log_detection(found)
        if current.state is PassState.ABANDONED:  # reported, and the next forward is checked afresh
            decisions.dump(found)
            decisions.state.set_detected_overflow(False)
            say("overflow_fast: that report is of a pass that an exception interrupted before its end (a "
                "KeyboardInterrupt in a forward, any exception in a backward); it stops nothing, and what "
                "runs next is checked afresh")
            return
        if self.strategy.stops():
            decisions.dump(found)
            if self.sync_wanted() and (self.thread.calls or current.state is PassState.ENDING
                                       or graph_task_id() != -1):
                # the other ranks are mid-pass, inside their own collectives (DDP, FSDP2, tensor
                # parallel): stop with them when this pass ends, not here
                current.stop_at_agreement(found.detection, found.frames)
                return
            raise overflow_error(found.detection, found.frames)
        decisions.state.set_detected_overflow(False)  # go on: later batches are checked afresh
        if found.report_due:
            decisions.dump(found)
        self.strategy.went_on(found.detection, found.frames, found.first_frame, found.bad, found.report_due)
        decisions.state.frames.clear()

    def sync_wanted(self):
        """Whether this detector's decisions are agreed between ranks (see overflow_fast.distributed)."""
        return self.ranks.wanted()

    def _agree(self, stop, phase):
        """Every rank learns which ranks detected; all raise together (``rank_agreement``).
        ``stop``: this rank's detection, (detection, frames), or None."""
        self.ranks.end_of_pass(stop, BACKWARD_END if phase == BACKWARD else FORWARD_END, self.decisions.state)


def _earlier_detectors_decide(passes):
    """Before ``passes``' detector reports a nan/inf, each detector made before it decides the calls
    of its forward pass running on this thread: where both watch a module, the earlier one's hooks
    ran first there, so it reports first (and raises: the later one never does), as it would with
    check="module" and as the reference does."""
    for made in sorted(_live.keys()):
        if made >= passes.made:
            break
        other = _live.get(made)
        running = other.thread.forward if other is not None else None
        if running is not None and running.state is PassState.RUNNING and running.queue:
            with other.lock:
                other.flush(running)
