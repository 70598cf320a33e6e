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

``Passes`` owns all of this: each pass's state (``PassState``), the calls running on each thread,
what find_op keeps for a replay; the detector's hooks only call its methods. It is made fresh for a
detector and for each copy or pickle of it: it holds the lock, device buffers and the strategy's
state, none of which a copy may share, and a detector whose calls wait for their decision refuses
to be copied (``waiting``).
"""

import functools
import itertools
import sys
import threading

import torch

from . import explain
from .. import distributed
from ..replay.culprit import autocast_state, root_state, root_state_at_end
from .compiled import Traced
from .decisions import NO_ROWS, Pending
from .frames import FORWARD, entries_of, forward_items, graph_task_id, recomputing, transform_level
from .hook_core import entries_reader, kept_call_class
from .on_detect import strategy
from .pass_ends import PassEnds, PassState
from .rank_agreement import RankAgreement
from .reads import Reads
from .scaling import Backoffs
from .text import TENSOR, abort_error

# tuple.__new__ in C: namedtuple's own __new__ and _make are Python calls (this runs at every hook)
_pending = functools.partial(tuple.__new__, Pending)
# (an enum member read on its class is a lookup through the metaclass, about 70 ns: these are read at every hook)
_CLOSED, _STOPPING = PassState.CLOSED, PassState.STOPPING


class Pass:
    """The calls of one pass waiting for their decision, and the rows that hold their statistics."""

    __slots__ = ("reads", "queue", "serial", "state", "stop", "task", "scaling", "autocast", "model_inputs")

    def __init__(self, reads, serial):
        self.reads = reads  # None once CLOSED
        self.queue = []  # Pending calls, in hook order
        self.serial = serial  # None for the backward pass
        self.state = PassState.RUNNING
        self.stop = None  # STOPPING: (detection, frames), raised at the agreement
        self.task = -1  # a backward pass: the graph task whose end was to decide it
        self.scaling = None  # a backward pass: its GradScaler's (scaling.Scaling), for the graph task it names
        self.autocast = None  # a forward pass begun under autocast: {device type: dtype} (else None)
        self.model_inputs = None  # the model's own call's inputs: (entries, dtypes, sources, tensors), read first

    def key(self, batch):
        """Which pass a detection belongs to (later frames of the same pass only pass the values on)."""
        return ("forward", self.serial) if self.serial is not None else ("backward", batch)

    @property
    def stopping(self):
        return self.state is PassState.STOPPING

    def stop_at_agreement(self, detection, frames):
        self.state, self.stop = PassState.STOPPING, (detection, frames)

    def begin_ending(self):
        if self.state is PassState.RUNNING:
            self.state = PassState.ENDING

    def abandon(self):
        if self.state is PassState.STOPPING:  # the calls after its detection never happened
            self.queue, self.stop = [], None
        self.state = PassState.ABANDONED

    def close(self):
        """CLOSED; returns the detection it stops with at the agreement, if any."""
        stop, self.stop = self.stop, None
        self.reads, self.state, self.model_inputs = None, PassState.CLOSED, None
        return stop


class _ThreadState(threading.local):
    """Per thread: the hooked calls running (each with the exception being handled when it started:
    a post hook that sees another one runs because the call raised), the frame that runs the
    outermost of them (its hook's caller, torch's, on the stack until that call ends) and the
    forward pass."""

    def __init__(self):
        self.calls = []  # (module, exception being handled when it started, its KeptCall or None)
        self.outer = None
        self.forward = None


def computed_in(entries, dtypes, tensor):
    """The dtype a forward call computed in under autocast: autocast's for its tensors' device type,
    where it is on there and an output has that dtype (its op cast its inputs and weights to it:
    a Linear's); else None (a LayerNorm under autocast computes in float32)."""
    device = tensor.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    for kind, ctx, payload in entries:
        if kind == TENSOR and ctx.startswith("output") and dtypes[payload] == dtype:
            return dtype
    return None



def on_stack(frame):
    """Whether ``frame`` is running on this thread now (its frames are walked: call it rarely)."""
    current = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


class Passes(PassEnds):
    """A detector's passes (``options``, ``decisions``, its ``model``, the ``backend`` its hooks ask
    for, its ``gradients.GradientHooks`` or None)."""

    def __init__(self, options, decisions, model, backend, gradients):
        self.options = options
        self.decisions = decisions
        self.model = model
        self.gradients = gradients
        # the options the hooks ask at every call, read once
        self.keeps_calls = options.keeps_calls
        self.decides_each_call = options.check == "module"
        self.may_defer = options.defer and options.check == "batch"
        self.abort_after = None if options.abort_after_batch_num is None else int(options.abort_after_batch_num)
        self.buffer_rows = options.buffer_rows  # a pass's calls waiting at most: then they are decided
        self.sync_timeout = options.sync_timeout
        self.strategy = strategy(options.on_detect, model, options.max_skips)
        self.lock = threading.RLock()  # hooks may run on several threads
        self.thread = _ThreadState()
        self.backward = None  # the backward pass, while it has calls
        self.open = []  # every pass with calls (close() decides them)
        self.idle_reads = []  # rows of ended passes, reused by the next ones
        self.serials = itertools.count()
        self.new_reads = lambda: Reads(backend, options.buffer_rows, options.reuse_stats, options.stage_bytes)
        self.apart = None  # the Reads of calls read on their own (create_frame)
        self.entries_of = None  # the entries of hook calls outside transforms, one C++ pass where it loads
        self.outputs = None  # watch(): the gradients' OutputGradients (GradientHooks.output_hooks), with it
        self.kept_call = None  # find_op's KeptCall class (hook_core.kept_call_class), with the first call
        self.traced = Traced()  # hooks traced by torch.compile, replayed by the next eager hook
        # the last clean pass's calls, freed when the next pass begins (not between a forward's
        # read and its backward: on a GPU the device would idle that long)
        self.spent = None
        self.flush_task = None  # the backward (graph task) whose end will decide the backward pass
        # find_op: the last forward's calls (autograd on) and the gradients arriving at their
        # outputs (by the output tensor's id), kept until its backward pass ends
        self.kept_forward = []
        self.kept_gradients = {}
        self.autocast = {}  # find_op: the autocast the current forward runs under
        self.collective_writes = None  # held from the first pass under torch.distributed
        # gradient checks: which backwards a GradScaler scaled, and when its backoff is a detection
        self.backoffs = Backoffs(options.min_loss_scale, options.max_backoffs) if options.backward else None
        self.ranks = RankAgreement(options.sync, options.sync_timeout, self.strategy)
        self.made = self._live_from_now()

    # -- which pass ------------------------------------------------------------------------------

    def _open_pass(self, serial):
        if self.collective_writes is None:
            # in-place collectives bump the version counters of what they write (once a process
            # group exists), so that a row read before such a write is never reused after it
            self.collective_writes = distributed.seen_as_writes()
        if self.entries_of is None:  # (with the first rows: the extension may be built here)
            self.entries_of = entries_reader(self.options.containers)
            self.outputs = self.gradients.output_hooks() if self.gradients is not None else None
        reads = self.idle_reads.pop() if self.idle_reads else self.new_reads()
        opened = Pass(reads, serial)
        if serial is not None:
            opened.autocast = autocast_state() or None  # (two flags read per forward: the calls ask only under it)
        self.open.append(opened)
        return opened

    def forward_pass(self):
        """This thread's forward pass (opened by its first call)."""
        current = self.thread.forward
        if current is None or current.state is _CLOSED:
            current = self.thread.forward = self._open_pass(next(self.serials))
        return current

    def backward_pass(self):
        if self.backward is None:
            self.backward = self._open_pass(None)
        return self.backward

    def _close(self, ended):
        """Free an ended pass's rows (after its calls were replayed); returns the detection it stops
        with at the agreement, if any."""
        if ended.state is PassState.CLOSED:
            return None
        ended.reads.reset()
        if ended in self.open:
            self.open.remove(ended)
            self.idle_reads.append(ended.reads)
        if self.thread.forward is ended:
            self.thread.forward = None
        if self.backward is ended:
            self.backward = None
        return ended.close()

    # -- the hooked calls on this thread -------------------------------------------------------------

    def call_starts(self, module, args, kwargs=None, depth=1):
        """A hooked call starts (its pre hook). ``depth``: where the frame that runs the call is on
        the stack (1: this method's caller; read only for the first call of a forward: this runs at
        every call). The first call of a forward pass begins it; a call of the outermost module (or
        the model) while the frame that called it is no longer running abandons the calls before it
        (see the module)."""
        thread = self.thread
        calls = thread.calls
        if calls and (module is calls[0][0] or module is self.model) and not on_stack(thread.outer):
            with self.lock:
                self.abandon_forward()
        if not calls:
            thread.outer = sys._getframe(depth)  # on the stack until that call returns
            if self.kept_call is None and self.keeps_calls:  # (the extension may be built here)
                self.kept_call = kept_call_class()
            if graph_task_id() == -1 or not recomputing():  # (a forward a backward hook runs begins too)
                with self.lock:
                    self._forward_begins(module is self.model)
                    if module is self.model and self.decisions.explain and transform_level() is None:
                        explain.read_model_inputs(self, args, kwargs)  # (inside torch.func: its own tensors)
        kept = self.kept_call(module, args, kwargs, calls[-1][2] if calls else None, self.autocast, root_state) \
            if self.keeps_calls else None
        calls.append((module, sys.exception(), kept))

    def _forward_begins(self, by_the_model):
        task = graph_task_id()  # -1, or the backward whose hook runs this forward
        if self.flush_task is not None and self.flush_task != task:  # the last backward failed before its end
            self.abandon_backward()
        self.spent = None
        if task == -1:  # (a backward running keeps what its replay needs)
            self.kept_forward = []  # what an earlier forward kept for its backward's replay
        if self.keeps_calls:
            self.autocast = autocast_state()
        if by_the_model and self.gradients is not None:
            self.gradients.new_forward()

    def call_returns(self, module, args, kwargs):
        """A hooked call returned or raised (its post hook): ``(exception being handled when it
        started, its KeptCall or None, whether it was the outermost)``."""
        calls = self.thread.calls
        # no entry of its own: its pre hook did not run (another one before it raised, or the
        # detector was attached during the call)
        _, ambient, kept = calls.pop() if calls and calls[-1][0] is module else (None, None, None)
        if kept is None and module is self.model and not calls and self.keeps_calls:
            # a compiled model: its pre hook was traced; its call as seen at its end, for find_op
            with self.lock:
                self.kept_forward = []
            if self.kept_call is None:
                self.kept_call = kept_call_class()
            kept = self.kept_call(module, args, kwargs, None, autocast_state(), root_state_at_end)
        if not calls:
            self.thread.outer = None  # (it holds the call's inputs and result)
        return ambient, kept, not calls

    def keep_gradient(self, tensor_id, grad):
        """find_op: the gradient arriving at a forward output (its id), kept for the backward's replay."""
        self.kept_gradients[tensor_id] = grad

    def decide_apart(self, module, entries, dtypes, tensors):
        """A hook call read and decided on its own (``create_frame``): one host read, its frame saved."""
        with self.lock:
            if self.apart is None:
                self.apart = self.new_reads()
            sources = self.apart.read_apart(tensors) if tensors else NO_ROWS
            frame = self.decisions.frame(self.apart, Pending(None, module, entries, dtypes, sources, FORWARD))
            self.decisions.save(frame)

    def waiting(self):
        """Whether calls wait for their decision (a pass is running): a copy would not carry them."""
        return (bool(self.traced) or bool(self.thread.calls)
                or any(open_pass.queue for open_pass in self.open))

    # -- calls -----------------------------------------------------------------------------------

    def decides_now(self, call):
        """Whether a call is decided at once: with check="module", in a traced batch, after a detection."""
        return self.decides_each_call or call.trace_mode or self.decisions.state.detected_overflow

    def add(self, current, call, module, entries, dtypes, tensors, phase, consumers=None, kept_call=None):
        """Read a call's tensors (or let them wait, see ``reads``) and queue the call; decide now
        with check="module", in a traced batch and after a detection (``decides_now``, inlined:
        this runs at every hook)."""
        now = self.decides_each_call or call.trace_mode or self.decisions.state.detected_overflow
        if not tensors:
            sources = NO_ROWS
        else:
            reads = current.reads
            site = (id(module) if self.may_defer and reads.may_wait(not now, phase, call.trace_mode, tensors)
                    else -1)
            sources = reads.add(tensors, site)
            if sources is None:
                sources = self._after_full(current, tensors, site)
        # decided now: its tensors stay referenced until then, for a detection's Where line
        queue = current.queue
        queue.append(_pending((call, module, entries, dtypes, sources, phase, consumers, kept_call,
                               tensors if now else None,
                               None if current.autocast is None or not tensors else computed_in(entries, dtypes,
                                                                                               tensors[0]))))
        if now or len(queue) >= self.buffer_rows:
            self.flush(current)

    def forward_returned(self, module, input, output, kwargs, recomputed, transformed, kept):
        """A forward hook call returned (not raised): count it, read its tensors (or let them wait, see
        ``reads``), hook its outputs' gradients (``watch``), give find_op's kept call (``kept``, or
        None) its output, and queue it in this thread's forward pass, or with ``recomputed`` (run in
        a backward: activation checkpointing) in the backward pass, which decides it. Outside
        torch.func (``transformed``: it takes gradients functionally, no output hooks) all but the
        count and the queue are the hook layer's one C++ call (``Reads.add_forward``). Decided now as
        ``add`` says (inlined, as ``forward_pass`` is: this runs at every hook)."""
        if recomputed:
            current = self.backward_pass()
        else:
            current = self.thread.forward
            if current is None or current.state is _CLOSED:
                current = self.thread.forward = self._open_pass(next(self.serials))
        if self.traced.records:
            self.traced.absorb(self, current, self.model, kept)  # a compiled region ran before this call
        if current.state is _STOPPING:
            return  # this rank reported; it stops with the others when the pass ends
        state = self.decisions.state
        call = state.count(module is self.model, recomputed)
        now = self.decides_each_call or call.trace_mode or state.detected_overflow
        reads = current.reads
        if transformed:
            entries, tensors, dtypes = entries_of(forward_items(module, input, output, kwargs, self.options.containers),
                                                  True)
            if kept is not None:
                kept.returned(output)
            site = id(module) if self.may_defer and reads.may_wait(not now, FORWARD, call.trace_mode, tensors) else -1
            sources = reads.add(tensors, site) if tensors else NO_ROWS
        else:
            site = id(module) if self.may_defer and reads.may_wait_in_forward(not now, call.trace_mode) else -1
            entries, tensors, dtypes, sources = reads.add_forward(self.entries_of, module, input, output, kwargs,
                                                                  self.outputs, kept, site)
            if not tensors:
                sources = NO_ROWS
            elif sources is None:
                site = reads.site_of(tensors, site)
        if sources is None:
            sources = self._after_full(current, tensors, site)
        if kept is not None and kept.grad_enabled and self.gradients is not None:
            self.kept_forward.append(kept)  # until its backward pass ends: that backward's replay runs it again
        queue = current.queue  # (as ``add`` queues)
        queue.append(_pending((call, module, entries, dtypes, sources, FORWARD, None, kept, tensors if now else None,
                               None if current.autocast is None or not tensors else computed_in(entries, dtypes,
                                                                                               tensors[0]))))
        if now or len(queue) >= self.buffer_rows:
            self.flush(current)
        if kept is not None and not kept.grad_enabled and self.thread.calls:
            kept.release()  # autograd keeps nothing here: neither does a call that returned (culprit)
        if recomputed:
            self.decide_when_backward_ends()
        if self.abort_after is not None and state.batch_number > self.abort_after:
            self.flush(current)
            raise ValueError(abort_error(state.batch_number, self.options.abort_after_batch_num))

    def _after_full(self, current, tensors, site):
        """A call's sources where the buffer had no room: what waits is decided now, then added."""
        self.flush(current)
        current.reads.reset()
        return current.reads.add(tensors, site)

    def queue(self, current, pending, now=False):
        current.queue.append(pending)
        if now or len(current.queue) >= self.buffer_rows:
            self.flush(current)

    def close(self):
        """The hooks are off: decide what waits (its records and detection still reach the log),
        free every row, let go of the strategy's own hooks and of every call kept."""
        self._live_no_more()
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
            for open_pass in list(self.open):
                self._close(open_pass)
            # nothing of the model stays reachable from a removed detector
            self.spent = None
            self.model = self.gradients = self.outputs = self.apart = None
            self.idle_reads = []
            self.traced = Traced()
            self._let_go_of_the_forward()  # its outputs' graph holds the gradient hooks, and they the model

