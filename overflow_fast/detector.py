"""The drop-in ``DebugUnderflowOverflow``: every module's forward records a frame of statistics per
call, and the last frames are printed when a nan/inf appears.

It reproduces transformers' detector byte for byte, but each call's tensors are read by one
``tensor_stats`` call in the hook (``reads``), the ring keeps raw numbers (text is built only when
printed), and with ``check="batch"`` no hook waits for the device: the rows are brought to the
host once, when the pass ends, and the calls are then replayed through the reference's state
machine (``reference``) in order.

A pass is the unit whose calls are decided together:
- a forward pass: the outermost hooked call on one thread, until it returns (each thread has its
  own, so threads driving one model never decide, or reset, each other's calls);
- the backward pass: every call made while autograd runs a backward (gradient frames, and the
  forwards that activation checkpointing recomputes), decided when that backward ends, before
  ``backward()`` returns and so before any optimizer step.
"""

import itertools
import operator
import sys
import threading
import warnings

import torch
from torch.compiler import is_compiling

from . import distributed, report
from .flight import StepLog
from .frames import BACKWARD, FORWARD, Frame, class_name, entries_of, forward_items, transform_level
from .gradients import GradientHooks
from .options import DEFAULT_BUFFER_ROWS, DEFAULT_DEFER_BYTES, DEFAULT_MAX_SKIPS, Options
from .policy import Policy, is_bad, source_line
from .reads import Reads, may_wait
from .reference import ReferenceState
from .report import NONE, NOT_A_TENSOR, UNREADABLE
from .skip import SkipStep
from .stats import tensor_stats, unreadable_reason
from .stats.dispatch import backend_status, requested_backend

_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
_NO_ROWS = (None, [], None)
try:  # how non-reentrant activation checkpointing stops a recompute early: control flow, not an error
    from torch.utils.checkpoint import _StopRecomputationError as _STOP_RECOMPUTATION
except ImportError:
    _STOP_RECOMPUTATION = ()


class OverflowDetected(ValueError):
    """The reference's ValueError on a detected inf/nan (same message, so ``except ValueError``
    and the text hold), carrying what was detected as data for a trainer to log or checkpoint:
    ``batch_number``, ``phase``, ``module_name``, ``class_name``, ``entries`` (of the first frame
    holding a nan/inf), ``global_step`` and ``mode`` (the trainer's optimizer step and "train" or
    "eval", where known: ``set_step``), ``rank`` (None in a single process), ``detection`` (those
    as a dict) and
    ``frames``: the reported frames, each ``{"module", "class", "phase", "entries": [{"entry",
    "dtype", "abs_min", "abs_max", "nan", "posinf", "neginf", "zero", "subnormal", "numel"}]}``.
    Other detectors on the same model tell by this class that the report is already printed."""

    def __init__(self, message, detection=None, frames=()):
        ValueError.__init__(self, message)  # not super(): a subclass also derives from OverflowOnRanks
        self.detection = detection
        detection = detection or {}
        self.batch_number = detection.get("batch_number")
        self.phase = detection.get("phase")
        self.module_name = detection.get("module")
        self.class_name = detection.get("class")
        self.entries = detection.get("entries", [])
        self.global_step = detection.get("global_step")
        self.mode = detection.get("mode")
        where = distributed.world()
        self.rank = where[0] if where else None
        self.frames = list(frames)


class OverflowDetectedOnRanks(OverflowDetected, distributed.OverflowOnRanks):
    """Raised on every rank once the ranks agreed that some of them detected a nan/inf; the
    message names them (``error.ranks``). On a rank that detected, ``detection`` and ``frames``
    are its own; elsewhere None and empty."""

    def __init__(self, ranks, world_size, detection=None, frames=()):
        distributed.OverflowOnRanks.__init__(self, ranks, world_size)
        OverflowDetected.__init__(self, str(self), detection, frames)


def _print(text):
    # under torch.distributed every line says which rank it comes from; flushed: a rank killed by
    # its launcher right after the error must leave its report
    print(distributed.with_prefix(text, distributed.rank_prefix()), flush=True)


class _Pass:
    """The calls of one pass waiting for their decision, and the rows that hold their statistics."""

    __slots__ = ("reads", "queue", "serial", "stop_pending", "deciding")

    def __init__(self, reads, serial):
        self.reads = reads
        self.queue = []  # _Pending calls, in hook order
        self.serial = serial  # None for the backward pass
        self.stop_pending = None  # (detection, frames): this rank detected; the error waits for the agreement
        self.deciding = False  # the pass is ending: a detection now waits for its agreement

    def key(self, batch):
        """Which pass a detection belongs to (later frames of the same pass only pass the values on)."""
        return ("forward", self.serial) if self.serial is not None else ("backward", batch)


class _Pending:
    """One hook call waiting for its rows: what the reference's counters said (``call``), its
    module, entries and dtypes, where its rows are (``sources``), its phase, and for an output
    gradient the modules whose backward produced it."""

    __slots__ = ("call", "module", "entries", "dtypes", "sources", "phase", "consumers")

    def __init__(self, call, module, entries, dtypes, sources, phase, consumers):
        self.call = call
        self.module = module
        self.entries = entries
        self.dtypes = dtypes
        self.sources = sources
        self.phase = phase
        self.consumers = consumers


class _ThreadState(threading.local):
    """Per thread: the hooked calls running (each with the exception being handled when it started:
    a post hook that sees another one runs because the call raised) and its forward pass."""

    def __init__(self):
        self.calls = []
        self.forward = None


class _Runtime:
    """What a detector holds while it runs, never carried by a copy or a pickle (they make their own)."""

    def __init__(self, detector):
        options = detector.options
        self.lock = threading.RLock()  # hooks may run on several threads
        self.thread = _ThreadState()
        self.backward = None  # the backward pass, while it has calls
        self.open = []  # every pass with calls (remove() decides them)
        self.idle_reads = []  # rows of ended passes, reused by the next ones
        self.serials = itertools.count()
        self.new_reads = lambda: Reads(detector.backend, options.buffer_rows, options.reuse_stats, options.stage_bytes)
        self.apart = None  # the Reads of calls read on their own (create_frame)
        self.traced = []  # records of hooks traced by torch.compile, not replayed yet (its identity is a guard)
        # the last clean pass's calls, freed when the next pass begins (not between a forward's
        # read and its backward: on a GPU the device would idle that long)
        self.spent = None
        self.flush_task = None  # the backward (graph task) whose end will decide the backward pass
        self.agreement = None  # with the other ranks (made when first needed, if not at construction)
        self.agreements = 0  # agreement points reached: their sequence numbers
        self.skip = SkipStep(detector.model, options.max_skips) if options.on_detect == "skip" else None

    def open_pass(self, serial):
        reads = self.idle_reads.pop() if self.idle_reads else self.new_reads()
        opened = _Pass(reads, serial)
        self.open.append(opened)
        return opened

    def close_pass(self, ended):
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

    def forward_pass(self):
        current = self.thread.forward
        if current is None or current.reads is None:
            current = self.thread.forward = self.open_pass(next(self.serials))
        return current

    def backward_pass(self):
        if self.backward is None:
            self.backward = self.open_pass(None)
        return self.backward


class DebugUnderflowOverflow:
    """Detect the first inf/nan in a model's weights, inputs and outputs, and print the frames
    that led to it. Same arguments, attributes, text and errors as
    ``transformers.debug_utils.DebugUnderflowOverflow``, plus the options of ``docs/options.md``
    (all off by default; ``watch()`` turns on the recommended ones):

    - ``check="module"`` (default) decides at each module, as the reference does, with one host
      read per hook; ``check="batch"`` never waits for the device in a hook and decides when the
      pass ends, printing exactly the same report.
    - ``backend``, ``buffer_rows``, ``reuse_stats``, ``defer``, ``stage_bytes``: how tensors are read
      (``overflow_fast.reads``).
    - ``kwargs``, ``containers``: keyword tensor inputs and tensors inside containers get lines.
    - ``backward``: gradient frames (``overflow_fast.gradients``), decided before ``backward()`` returns.
    - ``on_detect``, ``ignore``, ``warn_above``, ``warn_gradients``: ``overflow_fast.policy``;
      ``on_detect="skip"`` and ``max_skips``: ``overflow_fast.skip``.
    - ``sync``, ``sync_timeout``: ``overflow_fast.distributed``.
    - ``log``, ``log_every``: the flight recorder (``overflow_fast.flight``).
    - ``set_step(global_step, mode)``: the trainer's optimizer step and "train"/"eval", carried by
      detections, errors, records and the report's ``Step:`` line (the integrations call it).
    - ``remove()`` and use as a context manager take the hooks off again.
    """

    def __init__(self, model, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None,
                 check="module", backend=None, buffer_rows=DEFAULT_BUFFER_ROWS, reuse_stats=True,
                 kwargs=False, containers=False, backward=False, on_detect="raise", ignore=(),
                 warn_above=None, sync=True, sync_timeout=None, log=None, log_every=1,
                 defer=False, stage_bytes=DEFAULT_DEFER_BYTES, max_skips=DEFAULT_MAX_SKIPS,
                 warn_gradients=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        options = Options.of(
            max_frames_to_save=max_frames_to_save, trace_batch_nums=trace_batch_nums,
            abort_after_batch_num=abort_after_batch_num, check=check, backend=backend, buffer_rows=buffer_rows,
            reuse_stats=reuse_stats, kwargs=kwargs, containers=containers, backward=backward,
            on_detect=on_detect, ignore=ignore, warn_above=warn_above, sync=sync, sync_timeout=sync_timeout,
            log=log, log_every=log_every, defer=defer, stage_bytes=stage_bytes, max_skips=max_skips,
            warn_gradients=warn_gradients)
        self.options = options
        self.model = model
        self.trace_batch_nums = options.trace_batch_nums
        self.abort_after_batch_num = options.abort_after_batch_num
        self._abort_after = None if abort_after_batch_num is None else int(abort_after_batch_num)
        self.prefix = report.PREFIX
        self.check = options.check
        self.backend = _usable_backend(options.backend)
        self.reuse_stats = options.reuse_stats
        self.defer = options.defer and options.check == "batch"
        self.kwargs = options.kwargs
        self.containers = options.containers
        self.backward = options.backward
        self.max_skips = options.max_skips
        self.sync = options.sync
        self.sync_timeout = options.sync_timeout
        self._policy = Policy(options.on_detect, options.ignore, options.warn_above, options.warn_gradients)
        self.global_step = None  # the trainer's optimizer step, where known (set_step)
        self.mode = None  # "train" or "eval", where known
        self.detections = []  # what was detected: batch_number, phase, module, class, entries
        self._log = StepLog(options.log, options.log_every) if options.log is not None else None
        self._state = ReferenceState(options.max_frames_to_save, options.trace_batch_nums)
        self._handles = []
        self._gradients = None
        self._run = _Runtime(self)
        if self._sync_wanted():
            # collective: every rank builds its detector here; a rank alone fails here, in time
            self._run.agreement = distributed.Agreement(timeout=self.sync_timeout)
        self.analyse_model()
        self.register_forward_hook()

    # -- the reference's attributes (its state machine's) -------------------------------------

    frames = property(lambda self: self._state.frames, lambda self, value: setattr(self._state, "frames", value))
    frame = property(lambda self: self._state.frame, lambda self, value: setattr(self._state, "frame", value))
    batch_number = property(lambda self: self._state.batch_number,
                            lambda self, value: setattr(self._state, "batch_number", value))
    total_calls = property(lambda self: self._state.total_calls,
                           lambda self, value: setattr(self._state, "total_calls", value))
    detected_overflow = property(lambda self: self._state.detected_overflow,
                                 lambda self, value: setattr(self._state, "detected_overflow", value))

    # -- the reference's methods ------------------------------------------------------------

    def save_frame(self, frame=None):
        if frame is not None:
            self.expand_frame(frame)
        self.frames.append("\n".join(self.frame))
        self.frame = []

    def expand_frame(self, line):
        self.frame.append(line)

    def trace_frames(self):
        _print("\n".join(str(frame) for frame in self.frames))
        self.frames.clear()

    def reset_saved_frames(self):
        self.frames.clear()

    def dump_saved_frames(self, during=None):
        _print(report.dump_text(self.batch_number, self.frames, during))
        self.frames.clear()

    def analyse_model(self):
        # first name wins for a module reachable under several names
        self.module_names = {m: name for name, m in self.model.named_modules()}

    def analyse_variable(self, var, ctx):
        """Add one line for ``var`` to the frame being built, printing its nan/inf lines at once."""
        if isinstance(var, torch.Tensor):
            row = _row_of(var, "analyse_variable")  # one read serves the line and the check
            if isinstance(row, str):
                self.expand_frame(report.entry_line(UNREADABLE, ctx, row))
                return
            self.expand_frame(report.tensor_line(row, var.dtype, ctx))
            for line in report.overflow_lines(row, ctx):
                _print(line)
            if is_bad(row):
                self.detected_overflow = True
        elif var is None:
            self.expand_frame(report.entry_line(NONE, ctx, None))
        else:
            self.expand_frame(report.entry_line(NOT_A_TENSOR, ctx, None))

    def batch_start_frame(self):
        self.frame.extend(report.batch_start_lines(self.batch_number))

    def batch_end_frame(self):
        self.expand_frame(report.batch_end_line(self.batch_number - 1))

    def create_frame(self, module, input, output):
        """Build, check and save the frame of one hook call right away (one host read)."""
        entries, tensors, dtypes = entries_of(forward_items(module, input, output))
        with self._run.lock:
            if self._run.apart is None:
                self._run.apart = self._run.new_reads()
            sources = self._run.apart.read_apart(tensors) if tensors else _NO_ROWS
            self._save(None, self._frame(self._run.apart, module, entries, dtypes, FORWARD, None, sources))

    def register_forward_hook(self):
        self.model.apply(self._register_forward_hook)
        if self.backward:
            self._gradients = GradientHooks(self.model, self.module_names, self._gradient_hook)

    def _register_forward_hook(self, module):
        # A module shared by two parents is visited twice and so hooked twice, like the reference.
        # Pre hooks count the hooked calls running (a pass ends when the outermost returns); the
        # hooks run even when the call raises (always_call), to end its pass. The model's own is
        # kept out of a torch.compile graph: its eager run replays the traced calls.
        if module is self.model:
            after = self._after_model_with_kwargs if self.kwargs else self._after_model
        else:
            after = self._after_with_kwargs if self.kwargs else self._after
        self._handles.append(module.register_forward_pre_hook(self._before))
        self._handles.append(module.register_forward_hook(after, with_kwargs=self.kwargs, always_call=True))

    def forward_hook(self, module, input, output):
        """The reference's hook: record one forward call of ``module`` (a pass of its own when no
        hooked call is running on this thread)."""
        self._before(module, input)
        self._after(module, input, output)

    # -- additions --------------------------------------------------------------------------

    def remove(self):
        """Take every hook off the model, after deciding on any call still pending."""
        run = self._run
        with run.lock:
            handles, self._handles = self._handles, []
            for handle in handles:
                handle.remove()
            if self._gradients is not None:
                self._gradients.remove()
            if run.skip is not None:
                run.skip.close()
            run.thread = _ThreadState()  # calls running now will never end a pass
            try:
                self.flush()  # its records and detection still reach the log
            finally:
                for pending in list(run.open):
                    run.close_pass(pending)
                run.spent = None
                if self._log is not None:
                    self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.remove()
            return
        try:
            self.remove()
        except ValueError:
            pass  # the report is printed; the error already propagating is the one to see

    def __getstate__(self):
        # deepcopy(model) and torch.save(model) reach the detector through the model's hooks:
        # carry the configuration and the ring, not device buffers, pending calls or a lock
        state = {name: value for name, value in self.__dict__.items() if name != "_run"}
        state["_log"] = None  # a copy does not write into the original's log
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._run = _Runtime(self)

    def flush(self):
        """Read the pending statistics of every pass (one host read per device) and replay their
        calls in order. Raises the reference's ValueError if one of them holds a nan/inf."""
        with self._run.lock:
            for pending in list(self._run.open):
                self._flush(pending)

    def set_step(self, global_step=None, mode=None):
        """What runs next belongs to the trainer's optimizer step ``global_step`` (an int) and to
        ``mode`` ("train" or "eval"); detections, errors and records carry them. None: unknown."""
        if global_step is not None:
            global_step = _integer(global_step, "global_step", "an int or None")
            if global_step < 0:
                raise ValueError(f"global_step must be >= 0, got {global_step}")
        if mode not in (None, "train", "eval"):
            raise ValueError(f"mode must be 'train', 'eval' or None, got {mode!r}")
        with self._run.lock:
            skip = self._run.skip
            if skip is not None and skip.skipping and global_step is not None and global_step != self.global_step:
                skip.end()  # the trainer moved on: the skipped step is over (its scaler may have skipped it)
            self.global_step, self.mode = global_step, mode

    # -- passes -----------------------------------------------------------------------------

    def _before(self, module, args):
        if is_compiling():
            return
        thread = self._run.thread
        calls = thread.calls
        if not calls and _graph_task_id() == -1:
            with self._run.lock:
                self._run.spent = None
                if module is self.model and self._gradients is not None:
                    self._gradients.new_forward()
        calls.append((module, sys.exc_info()[1]))

    def _after(self, module, input, output):
        self._after_with_kwargs(module, input, None, output)

    @torch.compiler.disable
    def _after_model(self, module, input, output):
        self._after_with_kwargs(module, input, None, output)

    @torch.compiler.disable
    def _after_model_with_kwargs(self, module, input, kwargs, output):
        self._after_with_kwargs(module, input, kwargs, output)

    def _after_with_kwargs(self, module, input, kwargs, output):
        if is_compiling():
            return self._traced_hook(module, input, output, kwargs)
        calls = self._run.thread.calls
        # no entry of its own: its pre hook did not run (another one before it raised, or the
        # detector was attached during the call)
        ambient = calls.pop()[1] if calls and calls[-1][0] is module else None
        error = sys.exc_info()[1]
        raised = error is not None and error is not ambient  # run by torch because the call raised
        if _graph_task_id() != -1:
            # recomputed in backward (activation checkpointing): the backward pass decides it
            if not raised:
                with self._run.lock, _functorch_off(transform_level() is not None) as transformed:
                    self._forward_call(self._run.backward_pass(), module, input, output, kwargs, True, transformed)
            return
        with self._run.lock, _functorch_off(transform_level() is not None) as transformed:
            current = self._run.forward_pass()
            try:
                if not raised:
                    self._forward_call(current, module, input, output, kwargs, False, transformed)
            except BaseException as failure:
                if not calls:
                    self._end_forward(current, failure)
                raise
            if not calls:
                self._end_forward(current, error if raised else None)

    def _end_forward(self, ended, error):
        """The outermost hooked call returned (or raised ``error``): decide on its calls, then
        (under torch.distributed) agree with the other ranks."""
        ended.deciding = True
        try:
            if isinstance(error, OverflowDetected):
                ended.queue = []  # reported already, here or by another detector on this model
            else:
                try:
                    self._flush(ended)
                except ValueError:
                    if error is None or isinstance(error, _STOP_RECOMPUTATION):
                        raise
                    # torch silences (with a warning) what a hook raises here: annotate its error
                    if hasattr(error, "add_note"):
                        error.add_note("overflow_fast: an inf/nan was detected earlier in this forward; "
                                       "its report is printed above")
        finally:
            ended.deciding = False
            self._run.close_pass(ended)
            if self._sync_wanted():
                self._agree(ended, FORWARD)

    def _gradient_hook(self, module, items, consumers):
        with self._run.lock, _functorch_off(transform_level() is not None) as transformed:
            current = self._run.backward_pass()
            if current.stop_pending:
                return
            entries, tensors, dtypes = entries_of(items, transformed)
            self._add(current, self._state.count_backward(), module, entries, dtypes, tensors, BACKWARD, consumers)
            self._decide_when_backward_ends()

    def _decide_when_backward_ends(self):
        """Decide the backward pass when this backward ends, before ``backward()`` returns and so
        before the optimizer step."""
        if not (self.check == "batch" or self._sync_wanted()):
            return
        task = _graph_task_id()
        if self._run.flush_task == task:
            return
        self._run.flush_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self):
        run = self._run
        with run.lock:
            run.flush_task = None
            ended = run.backward_pass()
            ended.deciding = True
            try:
                self._flush(ended)
            finally:
                ended.deciding = False
                run.close_pass(ended)
                if self._sync_wanted():
                    self._agree(ended, BACKWARD)

    def _sync_wanted(self):
        """Whether this detector's decisions are agreed between ranks (see overflow_fast.distributed)."""
        return (self.sync and self._policy.on_detect in ("raise", "skip") and distributed.world() is not None
                and not distributed.is_local_only())

    def _agree(self, ended, phase):
        """One small collective on a process group of its own: every rank learns which ranks
        detected; all raise together (with on_detect="skip": all skip the step together). Its
        sequence number counts the agreement points and tells a forward's from a backward's, so
        ranks that meet at different points (uneven forwards, a backward one rank skipped after
        its forward raised) get an error naming them, never a decision."""
        pending, ended.stop_pending = ended.stop_pending, None
        run = self._run
        if run.agreement is None:
            run.agreement = distributed.Agreement(timeout=self.sync_timeout)
        run.agreements += 1
        seq = 2 * run.agreements + (phase == BACKWARD)
        skipping = run.skip is not None and run.skip.skipping
        ranks = run.agreement.agree(bool(pending) or skipping, seq=seq)
        if ranks and not pending and run.skip is not None:
            run.skip.begin()
        elif ranks:
            self.detected_overflow = True
            raise OverflowDetectedOnRanks(ranks, distributed.world()[1], *(pending or ()))

    # -- one hook call ----------------------------------------------------------------------

    def _forward_call(self, current, module, input, output, kwargs, recomputed, transformed):
        if self._run.traced:
            self._absorb_traced(current)  # a compiled region ran before this call
        if current.stop_pending:
            return  # this rank reported; it stops with the others when the pass ends
        entries, tensors, dtypes = entries_of(forward_items(module, input, output, kwargs, self.containers),
                                              transformed)
        call = self._state.count(module is self.model, recomputed)
        if self._gradients is not None and not transformed:  # torch.func takes gradients functionally
            self._gradients.watch_outputs(module, entries, tensors)
        self._add(current, call, module, entries, dtypes, tensors, FORWARD)
        if recomputed:
            self._decide_when_backward_ends()
        if self._abort_after is not None and self.batch_number > self._abort_after:
            self._flush(current)
            raise ValueError(report.abort_error(self.batch_number, self.abort_after_batch_num))

    def _add(self, current, call, module, entries, dtypes, tensors, phase, consumers=None):
        """Read a call's tensors (or let them wait, see ``reads``) and queue the call; decide now
        with check="module", in a traced batch and after a detection."""
        now = self._decides_now(call)
        if not tensors:
            sources = _NO_ROWS
        else:
            reads = current.reads
            site = id(module) if self.defer and not now and may_wait(True, phase, call.trace_mode, tensors) else -1
            sources = reads.add(tensors, site)
            if sources is None:  # the buffer is full: what waits is decided now
                self._flush(current)
                reads.reset()
                sources = reads.add(tensors, site)
        current.queue.append(_Pending(call, module, entries, dtypes, sources, phase, consumers))
        if now or len(current.queue) >= self.options.buffer_rows:
            self._flush(current)

    def _decides_now(self, call):
        """Whether a call is decided at once: with check="module", in a traced batch, after a detection."""
        return self.check == "module" or call.trace_mode or self.detected_overflow

    def _flush(self, current):
        """Read a pass's pending statistics (one host read per device) and replay its calls in
        order; raises the reference's ValueError at the first that holds a nan/inf."""
        queue, current.queue = current.queue, []
        if not queue:
            return
        nonfinite = current.reads.read()
        if not (nonfinite or self._log is not None or self._policy.warn_above is not None
                or self.detected_overflow or any(pending.call.trace_mode for pending in queue)):
            self._replay_finite(current, queue)
            self._run.spent = queue
            return
        for pending in queue:
            if current.stop_pending:
                break  # this rank reported; the calls after the detection never happened
            self._replay(current, pending)  # raises at the first bad call: those after it never happened

    def _frame(self, reads, module, entries, dtypes, phase, consumers, sources):
        frame = Frame(self.module_names.get(module, "?"), class_name(module), entries, dtypes, phase, consumers)
        reads.resolve(frame, sources)
        return frame

    def _replay(self, current, pending):
        """The reference's bookkeeping for one call whose rows are on the host."""
        call = pending.call
        frame = self._frame(current.reads, pending.module, pending.entries, pending.dtypes, pending.phase,
                            pending.consumers, pending.sources)
        state = self._state
        state.open(call)
        batch = call.batch_before  # a backward frame's call was counted with its forward's batch
        self._save(current, frame, batch)
        if self._log is not None:
            self._log.frame(frame, batch, self.global_step, self.mode)
        if call.trace_mode:
            # the reference's ring holds just this frame now, whatever max_frames_to_save says
            _print(str(frame))
            state.frames.clear()
        state.close(call)
        if state.detected_overflow and not call.trace_mode:
            if self._policy.on_detect == "raise":
                state.rewind(call)  # later calls may have run: they never happened
            self._detected(current, frame, batch, call.batch_after)

    def _replay_finite(self, current, queue):
        """``_replay`` of calls none of whose rows counts a nan/inf, with nothing to trace, warn or
        log: only the ring and the waiting batch lines change, and the ring keeps the last frames
        alone, so only those are made."""
        state = self._state
        keep = state.frames.maxlen
        first_kept = 0 if keep is None else len(queue) - keep
        for index, pending in enumerate(queue):
            state.open(pending.call)
            if index >= first_kept:
                state.save(self._frame(current.reads, pending.module, pending.entries, pending.dtypes,
                                       pending.phase, pending.consumers, pending.sources))
            else:
                state.drop(pending.phase)
            state.close(pending.call)

    def _save(self, current, frame, batch=None):
        """Print the frame's nan/inf lines, keep it in the ring (with the waiting lines as its lead)."""
        key = current.key(batch) if current is not None else None
        lines, detected = self._policy.check(frame, batch, self._step_of(batch), key)
        for line in lines:
            _print(line)
        if detected:
            self.detected_overflow = True
        self._state.save(frame)

    def _step_of(self, batch):
        """The training step a batch belongs to: the trainer's, where known."""
        return self.global_step if self.global_step is not None else batch

    def _detected(self, current, frame, batch, shown_batch):
        """A nan/inf counted in ``frame`` (or earlier, in a traced batch): report it as on_detect says."""
        detection, first_frame, bad, report_due = self._policy.conclude(frame, batch, self._step_of(batch),
                                                                        current.key(batch))
        if self.global_step is not None:
            detection["global_step"] = self.global_step
        if self.mode is not None:
            detection["mode"] = self.mode
        self.detections.append(detection)
        if self._log is not None:
            self._log.detection(detection)
        on_detect = self._policy.on_detect
        skip = self._run.skip
        frames = [report.frame_data(f) for f in self.frames if not isinstance(f, str)]
        if on_detect == "raise" or (skip is not None and skip.due_to_raise):
            self._dump(frame, first_frame, bad, batch, shown_batch)
            if self._sync_wanted() and (self._run.thread.calls or current.deciding or _graph_task_id() != -1):
                # the other ranks are mid-pass, inside their own collectives (DDP, FSDP2, tensor
                # parallel): stop with them when this pass ends, not here
                current.stop_pending = (detection, frames)
                return
            raise OverflowDetected(report.OVERFLOW_ERROR, detection, frames)
        self.detected_overflow = False  # go on: later batches are checked afresh
        if report_due:
            self._dump(frame, first_frame, bad, batch, shown_batch)
        if on_detect == "warn" and report_due:
            warnings.warn(f"overflow_fast: inf/nan in {first_frame.module_name or '(model)'} "
                          f"{', '.join(bad)} ({first_frame.phase}, batch_number={detection['batch_number']}); "
                          "training goes on (on_detect='warn')", RuntimeWarning, stacklevel=2)
        elif skip is not None:
            skip.begin()
            _print(f"overflow_fast: skipping this step: it applies no update ({skip.in_a_row + 1} "
                   f"skipped in a row, at most {skip.max_skips})")
        elif callable(on_detect):
            on_detect(OverflowDetected(report.OVERFLOW_ERROR, detection, frames))
        self.frames.clear()

    def _dump(self, frame, first_frame, bad, batch, shown_batch):
        """The reference's report (its batch number is the one its state had at that call), then
        the lines beyond it: the trainer's step where known, where the values were born."""
        during = f"the backward of batch_number={batch}" if frame.phase == BACKWARD else f"batch_number={shown_batch}"
        self.dump_saved_frames(during)
        if self.global_step is not None:
            mode = f" ({self.mode})" if self.mode is not None else ""
            _print(f"Step: optimizer step {self.global_step}{mode}, batch_number {batch}")
        if self.options.explain and bad:
            _print(source_line(first_frame, bad))

    # -- under torch.compile ----------------------------------------------------------------
    #
    # While dynamo traces a model, a forward hook must neither take the lock, nor read the
    # detector's counters (each value read would become a guard, and every batch a recompile),
    # nor sync. It only computes its rows inside the graph (one engine op node) and records the
    # call's entries; the records are replayed through the reference's state machine by the
    # first eager hook after the compiled region (the model's own is kept out of the graph).

    def _traced_hook(self, module, input, output, kwargs=None):
        entries, tensors, dtypes = entries_of(forward_items(module, input, output, kwargs, self.containers))
        rows = tensor_stats(tensors, self.backend).values if tensors else None
        self._run.traced.append((module, entries, dtypes, rows))

    def _absorb_traced(self, current):
        """Queue the records of a compiled region: one host read per device for all of them."""
        traced = self._run.traced
        records = list(traced)
        traced.clear()  # the same list: its identity is a guard of the compiled graph
        host = {}
        for device in {rows.device for _, _, _, rows in records if rows is not None}:
            host[device] = iter(torch.cat([rows for *_, rows in records
                                           if rows is not None and rows.device == device]).tolist())
        for module, entries, dtypes, rows in records:
            if current.stop_pending:
                return
            sources = current.reads.host([next(host[rows.device]) for _ in dtypes]) if rows is not None else _NO_ROWS
            call = self._state.count(module is self.model)
            current.queue.append(_Pending(call, module, entries, dtypes, sources, FORWARD, None))
            if self._decides_now(call):
                self._flush(current)


class _functorch_off:
    """Inside a torch.func transform (``active``), the hook's own work runs with functorch's
    dispatch off: what it allocates stays a plain tensor, and it reads the values under the
    wrappers (``frames.untransformed``). ``as`` gives ``active``."""

    __slots__ = ("active", "guard")

    def __init__(self, active):
        self.active = active
        self.guard = None

    def __enter__(self):
        if self.active:
            self.guard = torch._C._DisableFuncTorch()
            self.guard.__enter__()
        return self.active

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)
        return False


def _integer(value, name, expected):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}") from None


def _usable_backend(backend):
    """The backend the detector will ask for: a named backend that cannot run here warns once
    and gives way to the default choice, rather than failing every hook into a slow fallback."""
    requested_backend(None)  # a bad OVERFLOW_FAST_BACKEND is an error now, not at every hook
    if backend is not None:
        reason = backend_status()[backend]
        if reason is not None:
            warnings.warn(f"overflow_fast: backend={backend!r} is unavailable ({reason}); the detector "
                          "uses the default backend of each device instead ('cpu' for CPU tensors, "
                          "'triton' for CUDA ones, 'torch' where those cannot run)", RuntimeWarning,
                          stacklevel=3)
            return None
    return backend


def _row_of(var, caller):
    """One tensor's host row, or the reason the engine cannot read it (a string)."""
    if not isinstance(var, torch.Tensor):
        raise TypeError(f"{caller} expects a tensor, got {type(var).__name__}")
    reason = unreadable_reason(var)
    return reason if reason is not None else tensor_stats([var]).host_rows()[0]


def get_abs_min_max(var, ctx):
    """``"{abs min:8.2e} {abs max:8.2e} {ctx}"`` for a tensor, as the reference formats it."""
    row = _row_of(var, "get_abs_min_max")
    if isinstance(row, str):
        try:  # the reference's own ops, where torch can run them on this tensor
            abs_var = var.abs()
            return f"{abs_var.min():8.2e} {abs_var.max():8.2e} {ctx}"
        except Exception:
            return report.entry_line(UNREADABLE, ctx, row)
    return report.tensor_line(row, var.dtype, ctx)


def detect_overflow(var, ctx):
    """Print ``"{ctx} has nans"`` / ``"{ctx} has infs"`` and return True if ``var`` holds any."""
    row = _row_of(var, "detect_overflow")
    if isinstance(row, str):
        # the engine cannot read it: ask torch as the reference does, rather than answer False
        try:
            has_nans, has_infs = bool(torch.isnan(var).any()), bool(torch.isinf(var).any())
        except Exception:
            return False
        lines = ([f"{ctx} has nans"] if has_nans else []) + ([f"{ctx} has infs"] if has_infs else [])
    else:
        lines = report.overflow_lines(row, ctx)
    for line in lines:
        _print(line)
    return bool(lines)


WATCH_DEFAULTS = dict(check="batch", kwargs=True, containers=True, backward=True)


def watch(model, *, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None, check="batch",
          backend=None, buffer_rows=DEFAULT_BUFFER_ROWS, reuse_stats=True, kwargs=True, containers=True,
          backward=True, on_detect="raise", ignore=(), warn_above=None, sync=True, sync_timeout=None, log=None,
          log_every=1, defer=False, stage_bytes=DEFAULT_DEFER_BYTES, max_skips=DEFAULT_MAX_SKIPS,
          warn_gradients=False):
    """The detector with the recommended modern defaults: no host sync in any hook
    (``check="batch"``), keyword inputs, tensors inside model outputs and containers, and
    gradient checks in backward (a nan/inf there raises before ``backward()`` returns, so the
    optimizer never applies it). Every option is ``DebugUnderflowOverflow``'s (``docs/options.md``).
    Returns the detector: ``remove()`` it, or use it as a context manager."""
    return DebugUnderflowOverflow(
        model, max_frames_to_save=max_frames_to_save, trace_batch_nums=trace_batch_nums,
        abort_after_batch_num=abort_after_batch_num, check=check, backend=backend, buffer_rows=buffer_rows,
        reuse_stats=reuse_stats, kwargs=kwargs, containers=containers, backward=backward, on_detect=on_detect,
        ignore=ignore, warn_above=warn_above, sync=sync, sync_timeout=sync_timeout, log=log, log_every=log_every,
        defer=defer, stage_bytes=stage_bytes, max_skips=max_skips, warn_gradients=warn_gradients)
