"""The drop-in ``DebugUnderflowOverflow``: every module's forward records a frame of statistics per
call, and the last frames are printed when a nan/inf appears.

It reproduces transformers' detector byte for byte, but each call's tensors are read by one
``tensor_stats`` call in the hook (``reads``), the ring keeps raw numbers (text is built only when
printed), and with ``check="batch"`` no hook waits for the device: the rows are brought to the
host once, when the outermost hooked call returns, and the calls are then replayed through the
reference's state machine (``reference``) in order.
"""

import operator
import sys
import threading
import warnings

import torch
from torch.compiler import is_compiling
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import distributed, report
from .flight import StepLog
from .frames import BACKWARD, FORWARD, Frame, class_name, entries_of, forward_items
from .gradients import GradientHooks
from .policy import DEFAULT_MAX_SKIPS, Policy, is_bad, source_line
from .reads import DEFAULT_DEFER_BYTES, Reads, may_wait
from .reference import ReferenceState
from .report import NONE, NOT_A_TENSOR, UNREADABLE
from .stats import tensor_stats, unreadable_reason
from .stats.dispatch import backend_status, check_backend_name, requested_backend

CHECK_MODES = ("module", "batch")
DEFAULT_BUFFER_ROWS = 1 << 16
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
_NO_ROWS = (None, [], None)
_RUNTIME = ("_reads", "_queue", "_running", "_lock", "_traced", "_spent", "_stop_pending", "_deciding",
            "_backward_flush_task", "_agreement", "_agreements", "_skipping", "_skips_in_a_row", "_optimizer_hooks")


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


class _Running(threading.local):
    """Per thread, the hooked calls running: for each, its module and the exception being handled
    when it started (a post hook that sees another one runs because the call raised)."""

    def __init__(self):
        self.calls = []


class DebugUnderflowOverflow:
    """Detect the first inf/nan in a model's weights, inputs and outputs, and print the frames
    that led to it. Same arguments, attributes, text and errors as
    ``transformers.debug_utils.DebugUnderflowOverflow``, plus:

    - ``check="module"`` (default) decides at each module, as the reference does, with one host
      read per hook; ``check="batch"`` never waits for the device in a hook and decides when the
      outermost hooked call returns (the model's forward, or each top-level submodule's when
      ``model.forward`` runs them directly), printing exactly the same report.
    - ``backend``: the ``tensor_stats`` backend (None picks the fastest per device).
    - ``reuse_stats``: within one pass, a tensor already read and unchanged (the same object, its
      version counter and data pointer unchanged: one module's output is the next one's input) is
      not read again. Writes that bypass the version counter (``.data``, custom kernels) between
      two hooks that see the same tensor are then not seen by the second: turn it off for those.
    - ``buffer_rows``: rows of a device's buffer of statistics (read early when full).
    - ``defer`` (check="batch", accelerators; off by default): a forward hook's tensors may wait
      and be read together at the end of the pass. It can miss: see ``overflow_fast.reads``.
      ``stage_bytes`` bounds the bytes that only deferral keeps alive.
    - ``kwargs``: keyword tensor inputs get lines too (``input[hidden_states]``); the reference
      sees positional inputs only.
    - ``containers``: tensors inside dicts, lists, ModelOutputs, dataclasses and nested tuples get
      lines named by their path (``output[loss]``) instead of one ``not a tensor`` line.
    - ``backward``: gradient frames (``overflow_fast.gradients``), decided before ``backward()``
      returns.
    - ``on_detect``, ``ignore``, ``warn_above``, ``warn_gradients``: ``overflow_fast.policy``;
      ``sync``, ``sync_timeout``: ``overflow_fast.distributed``.
    - ``log``, ``log_every``: the flight recorder (``overflow_fast.flight``): a JSONL path, a
      TensorBoard ``SummaryWriter``, a W&B run, or a list of them.
    - ``on_detect="skip"``: a step in which a nan/inf appears (forward or gradients) applies no
      update: its report is printed once, it is recorded once, every gradient of the model is
      dropped (set to None: as it is accumulated, when the backward pass ends and right before
      any ``torch.optim`` optimizer holding them steps), so the optimizer changes neither weights
      nor state, and training goes on; after ``max_skips`` skipped steps in a row it raises as
      "raise" does. A step ends when such an optimizer steps.
    - ``set_step(global_step, mode)``: the trainer's optimizer step and "train"/"eval", carried by
      detections, errors and records (the integrations call it).
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
        # The reference takes whatever its deque, `in` and `>` take: None (an unbounded ring),
        # numpy integers, 0-dim integer tensors, any container of batch numbers.
        if max_frames_to_save is not None:
            max_frames_to_save = _integer(max_frames_to_save, "max_frames_to_save", "an int or None")
            if max_frames_to_save < 0:
                raise ValueError(f"max_frames_to_save must be >= 0, got {max_frames_to_save}")
        if trace_batch_nums is None:
            trace_batch_nums = []
        if isinstance(trace_batch_nums, (str, bytes)) or not (
                hasattr(trace_batch_nums, "__contains__") or hasattr(trace_batch_nums, "__iter__")):
            raise TypeError(
                f"trace_batch_nums must be a container of batch numbers, got {type(trace_batch_nums).__name__}"
            )
        self._abort_after = None
        if abort_after_batch_num is not None:
            self._abort_after = _integer(abort_after_batch_num, "abort_after_batch_num", "an integer or None")
        if check not in CHECK_MODES:
            raise ValueError(f"check must be one of {CHECK_MODES}, got {check!r}")
        for name, value, least in (("buffer_rows", buffer_rows, 1), ("stage_bytes", stage_bytes, 0),
                                   ("max_skips", max_skips, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")

        self.model = model
        self.trace_batch_nums = trace_batch_nums
        self.abort_after_batch_num = abort_after_batch_num
        self.prefix = report.PREFIX
        self.check = check
        self.backend = _usable_backend(backend)
        self.reuse_stats = bool(reuse_stats)
        self.defer = bool(defer) and check == "batch"
        self.kwargs = bool(kwargs)
        self.containers = bool(containers)
        self.backward = bool(backward)
        self._policy = Policy(on_detect, ignore, warn_above, warn_gradients)
        self.max_skips = max_skips
        self.global_step = None  # the trainer's optimizer step, where known (set_step)
        self.mode = None  # "train" or "eval", where known
        # beyond the drop-in, a report ends with the line saying where the values were born
        self._explain = self.kwargs or self.containers or self.backward
        self.detections = []  # what was detected: batch_number, phase, module, class, entries
        # under torch.distributed: every rank stops together at the end of the pass in which any
        # rank detected (see overflow_fast.distributed for the hazards)
        self.sync = bool(sync)
        self.sync_timeout = sync_timeout
        self._log = StepLog(log, log_every) if log is not None else None  # the flight recorder
        self._state = ReferenceState(max_frames_to_save, trace_batch_nums)
        self._buffer_rows = buffer_rows
        self._stage_bytes = stage_bytes
        self._handles = []
        self._gradients = None
        self._new_runtime()
        if self._sync_wanted():
            # collective: every rank builds its detector here; a rank alone fails here, in time
            self._agreement = distributed.Agreement(timeout=sync_timeout)
        self.analyse_model()
        self.register_forward_hook()

    def _new_runtime(self):
        """What a detector holds while it runs (not carried by a copy or a pickle)."""
        self._reads = Reads(self.backend, self._buffer_rows, self.reuse_stats, self._stage_bytes)
        self._queue = []  # calls waiting for their rows: (call, module, entries, dtypes, sources, phase, consumers)
        self._running = _Running()
        self._lock = threading.RLock()  # hooks may run on several threads
        self._traced = []  # records of hooks traced by torch.compile, not replayed yet
        self._spent = None  # the last clean read's calls, freed when the next pass begins (not between
        # a forward's read and its backward: on a GPU the device would idle that long)
        self._stop_pending = False  # this rank detected; the error waits for the agreement
        self._deciding = False  # a pass is ending: a detection now waits for its agreement
        self._backward_flush_task = None  # the backward pass whose end will flush
        self._agreement = None  # with the other ranks (made when first needed, if not at construction)
        self._agreements = 0  # agreement points reached: their sequence numbers
        self._skipping = False  # on_detect="skip": this step applies no update
        self._skips_in_a_row = 0
        self._optimizer_hooks = []
        if self._policy.on_detect == "skip":
            self._optimizer_hooks = [register_optimizer_step_pre_hook(self._before_step),
                                     register_optimizer_step_post_hook(self._after_step)]

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
        sources = self._reads.read_apart(tensors) if tensors else _NO_ROWS
        self._save(self._frame(module, entries, dtypes, FORWARD, None, sources))

    def register_forward_hook(self):
        self.model.apply(self._register_forward_hook)
        if self.backward:
            self._gradients = GradientHooks(self.model, self.module_names, self._gradient_hook)
        if self._policy.on_detect == "skip":
            # a skipped step's gradients are dropped as they are accumulated (after the gradient
            # frames read them), whatever runs the backward: an optimizer's closure included
            self._handles.extend(p.register_post_accumulate_grad_hook(self._drop_if_skipping)
                                 for p in self.model.parameters() if p.requires_grad)

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
        with self._lock:
            handles, self._handles = self._handles, []
            for handle in handles:
                handle.remove()
            if self._gradients is not None:
                self._gradients.remove()
            for handle in self._optimizer_hooks:
                handle.remove()
            self._running = _Running()  # calls running now will never end a pass
            try:
                self.flush()  # its records and detection still reach the log
            finally:
                self._reads.reset()
                self._spent = None
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
        state = {name: value for name, value in self.__dict__.items() if name not in _RUNTIME}
        state["_log"] = None  # a copy does not write into the original's log
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._new_runtime()

    def flush(self):
        """Read the pending statistics (one host read per device) and replay their calls in order.

        Raises the reference's ValueError if one of them holds a nan/inf.
        """
        with self._lock:
            queue, self._queue = self._queue, []
            if not queue:
                return
            nonfinite = self._reads.read()
            if not (nonfinite or self._log is not None or self._policy.warn_above is not None
                    or self.detected_overflow or any(record[0].trace_mode for record in queue)):
                self._replay_finite(queue)
                self._spent = queue
                return
            for record in queue:
                if self._stop_pending:
                    break  # this rank reported; the calls after the detection never happened
                self._replay(record)  # raises at the first bad call: those after it never happened

    def set_step(self, global_step=None, mode=None):
        """What runs next belongs to the trainer's optimizer step ``global_step`` (an int) and to
        ``mode`` ("train" or "eval"); detections, errors and records carry them. None: unknown."""
        if global_step is not None:
            global_step = _integer(global_step, "global_step", "an int or None")
            if global_step < 0:
                raise ValueError(f"global_step must be >= 0, got {global_step}")
        if mode not in (None, "train", "eval"):
            raise ValueError(f"mode must be 'train', 'eval' or None, got {mode!r}")
        with self._lock:
            self.global_step, self.mode = global_step, mode

    # -- on_detect="skip": a bad step applies no update ----------------------------------------

    def _drop_if_skipping(self, parameter):
        if self._skipping:
            parameter.grad = None

    def _drop_gradients(self):
        for parameter in self.model.parameters():
            parameter.grad = None

    def _holds_parameters(self, optimizer):
        ours = {id(p) for p in self.model.parameters()}
        return any(id(p) in ours for group in optimizer.param_groups for p in group["params"])

    def _before_step(self, optimizer, args, kwargs):
        if self._skipping and self._holds_parameters(optimizer):
            self._drop_gradients()

    def _after_step(self, optimizer, args, kwargs):
        if self._holds_parameters(optimizer):
            with self._lock:
                self._skips_in_a_row = self._skips_in_a_row + 1 if self._skipping else 0
                self._skipping = False

    # -- passes: the outermost hooked call on a thread, and backward ---------------------------

    def _before(self, module, args):
        if is_compiling():
            return
        running = self._running.calls
        if not running:
            with self._lock:
                self._spent = None
                if module is self.model and self._gradients is not None:
                    self._gradients.new_forward()
        running.append((module, sys.exc_info()[1]))

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
        running = self._running.calls
        # no entry of its own: its pre hook did not run (another one before it raised, or the
        # detector was attached during the call)
        ambient = running.pop()[1] if running and running[-1][0] is module else None
        error = sys.exc_info()[1]
        raised = error is not None and error is not ambient  # run by torch because the call raised
        with self._lock:
            try:
                if not raised:
                    self._forward_call(module, input, output, kwargs)
            except BaseException as failure:
                if not running:
                    self._end_pass(failure)
                raise
            if not running:
                self._end_pass(error if raised else None)

    def _end_pass(self, error):
        """The outermost hooked call returned (or raised ``error``): decide on its calls, then
        (under torch.distributed) agree with the other ranks."""
        self._deciding = True
        try:
            if isinstance(error, OverflowDetected):
                self._queue = []  # reported already, here or by another detector on this model
            else:
                try:
                    self.flush()
                except ValueError:
                    if error is None:
                        raise
                    # torch silences (with a warning) what a hook raises here: annotate its error
                    if hasattr(error, "add_note"):
                        error.add_note("overflow_fast: an inf/nan was detected earlier in this forward; "
                                       "its report is printed above")
        finally:
            self._deciding = False
            self._reads.reset()
            if self._sync_wanted():
                self._agree(FORWARD)

    def _gradient_hook(self, module, items, consumers):
        with self._lock:
            if self._stop_pending:
                return
            entries, tensors, dtypes = entries_of(items)
            self._add(self._state.count_backward(), module, entries, dtypes, tensors, BACKWARD, consumers)
            if self.check == "batch" or self._sync_wanted():
                self._flush_when_backward_ends()

    def _flush_when_backward_ends(self):
        """Decide when the backward pass ends, before ``backward()`` returns and so before the
        optimizer step."""
        task = _graph_task_id()
        if self._backward_flush_task == task:
            return
        self._backward_flush_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._flush_after_backward)

    def _flush_after_backward(self):
        with self._lock:
            self._backward_flush_task = None
            self._deciding = True
            try:
                self.flush()
            finally:
                self._deciding = False
                self._reads.reset()
                if self._sync_wanted():
                    self._agree(BACKWARD)
            if self._skipping:
                self._drop_gradients()

    def _sync_wanted(self):
        """Whether this detector's decisions are agreed between ranks (see overflow_fast.distributed)."""
        return (self.sync and self._policy.on_detect in ("raise", "skip") and distributed.world() is not None
                and not distributed.is_local_only())

    def _agree(self, phase):
        """One small collective on a process group of its own: every rank learns which ranks
        detected; all raise together (with on_detect="skip": all skip the step together). Its
        sequence number counts the agreement points and tells a forward's from a backward's, so
        ranks that meet at different points (uneven forwards, a backward one rank skipped after
        its forward raised) get an error naming them, never a decision."""
        pending, self._stop_pending = self._stop_pending, False
        if self._agreement is None:
            self._agreement = distributed.Agreement(timeout=self.sync_timeout)
        self._agreements += 1
        seq = 2 * self._agreements + (phase == BACKWARD)
        ranks = self._agreement.agree(bool(pending) or self._skipping, seq=seq)
        if ranks and not pending and self._policy.on_detect == "skip":
            self._skipping = True
        elif ranks:
            self.detected_overflow = True
            raise OverflowDetectedOnRanks(ranks, distributed.world()[1], *(pending or ()))

    # -- one hook call ----------------------------------------------------------------------

    def _forward_call(self, module, input, output, kwargs=None):
        if self._traced:
            self._absorb_traced()  # a compiled region ran before this call
        if self._stop_pending:
            return  # this rank reported; it stops with the others when the pass ends
        entries, tensors, dtypes = entries_of(forward_items(module, input, output, kwargs, self.containers))
        call = self._state.count(module is self.model)
        if self._gradients is not None:
            self._gradients.watch_outputs(module, entries, tensors)
        self._add(call, module, entries, dtypes, tensors, FORWARD)
        if self._abort_after is not None and self.batch_number > self._abort_after:
            self.flush()
            raise ValueError(report.abort_error(self.batch_number, self.abort_after_batch_num))

    def _add(self, call, module, entries, dtypes, tensors, phase, consumers=None):
        """Read a call's tensors (or let them wait, see ``reads``) and queue the call; decide now
        with check="module", in a traced batch and after a detection."""
        now = self._decides_now(call)
        if not tensors:
            sources = _NO_ROWS
        else:
            site = id(module) if self.defer and not now and may_wait(True, phase, call.trace_mode, tensors) else -1
            sources = self._reads.add(tensors, site)
            if sources is None:  # the buffer is full: what waits is decided now
                self.flush()
                self._reads.reset()
                sources = self._reads.add(tensors, site)
        self._queue.append((call, module, entries, dtypes, sources, phase, consumers))
        if now or len(self._queue) >= self._buffer_rows:
            self.flush()

    def _decides_now(self, call):
        """Whether a call is decided at once: with check="module", in a traced batch, after a detection."""
        return self.check == "module" or call.trace_mode or self.detected_overflow

    def _frame(self, module, entries, dtypes, phase, consumers, sources):
        frame = Frame(self.module_names.get(module, "?"), class_name(module), entries, dtypes, phase, consumers)
        self._reads.resolve(frame, sources)
        return frame

    def _replay(self, record):
        """The reference's bookkeeping for one call whose rows are on the host."""
        call, module, entries, dtypes, sources, phase, consumers = record
        frame = self._frame(module, entries, dtypes, phase, consumers, sources)
        state = self._state
        state.open(call)
        # the batch a frame belongs to: a backward pass runs after its forward counted the batch
        batch = call.batch_before - 1 if phase == BACKWARD else call.batch_before
        self._save(frame, batch)
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
            self._detected(frame, batch, call.batch_after)

    def _replay_finite(self, queue):
        """``_replay`` of calls none of whose rows counts a nan/inf, with nothing to trace, warn or
        log: only the ring and the waiting batch lines change, and the ring keeps the last frames
        alone, so only those are made."""
        state = self._state
        keep = state.frames.maxlen
        first_kept = 0 if keep is None else len(queue) - keep
        for index, (call, module, entries, dtypes, sources, phase, consumers) in enumerate(queue):
            state.open(call)
            if index >= first_kept:
                state.save(self._frame(module, entries, dtypes, phase, consumers, sources))
            else:
                state.drop(phase)
            state.close(call)

    def _save(self, frame, batch=None):
        """Print the frame's nan/inf lines, keep it in the ring (with the waiting lines as its lead)."""
        lines, detected = self._policy.check(frame, batch, self._step_of(batch))
        for line in lines:
            _print(line)
        if detected:
            self.detected_overflow = True
        self._state.save(frame)

    def _step_of(self, batch):
        """The training step a batch belongs to: the trainer's, where known."""
        return self.global_step if self.global_step is not None else batch

    def _detected(self, frame, batch, shown_batch):
        """A nan/inf counted in ``frame`` (or earlier, in a traced batch): report it as on_detect says."""
        detection, first_frame, bad, report_due = self._policy.conclude(frame, batch, self._step_of(batch))
        if self.global_step is not None:
            detection["global_step"] = self.global_step
        if self.mode is not None:
            detection["mode"] = self.mode
        self.detections.append(detection)
        if self._log is not None:
            self._log.detection(detection)
        on_detect = self._policy.on_detect
        frames = [report.frame_data(f) for f in self.frames if not isinstance(f, str)]
        if on_detect == "raise" or (on_detect == "skip" and self._skips_in_a_row >= self.max_skips):
            self._dump(frame, first_frame, bad, batch, shown_batch)
            if self._sync_wanted() and (self._running.calls or self._deciding or _graph_task_id() != -1):
                # the other ranks are mid-pass, inside their own collectives (DDP, FSDP2, tensor
                # parallel): stop with them when this pass ends, not here
                self._stop_pending = (detection, frames)
                return
            raise OverflowDetected(report.OVERFLOW_ERROR, detection, frames)
        self.detected_overflow = False  # go on: later batches are checked afresh
        if report_due:
            self._dump(frame, first_frame, bad, batch, shown_batch)
        if on_detect == "warn" and report_due:
            warnings.warn(f"overflow_fast: inf/nan in {first_frame.module_name or '(model)'} "
                          f"{', '.join(bad)} ({first_frame.phase}, batch_number={detection['batch_number']}); "
                          "training goes on (on_detect='warn')", RuntimeWarning, stacklevel=2)
        elif on_detect == "skip":
            self._skipping = True
            _print(f"overflow_fast: skipping this step: it applies no update ({self._skips_in_a_row + 1} "
                   f"skipped in a row, at most {self.max_skips})")
        elif callable(on_detect):
            on_detect(OverflowDetected(report.OVERFLOW_ERROR, detection, frames))
        self.frames.clear()

    def _dump(self, frame, first_frame, bad, batch, shown_batch):
        """The reference's report (its batch number is the one its state had at that call)."""
        during = f"the backward of batch_number={batch}" if frame.phase == BACKWARD else f"batch_number={shown_batch}"
        self.dump_saved_frames(during)
        if self._explain and bad:
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
        self._traced.append((module, entries, dtypes, rows))

    def _absorb_traced(self):
        """Queue the records of a compiled region: one host read per device for all of them."""
        records = list(self._traced)
        self._traced.clear()  # the same list: its identity is a guard of the compiled graph
        host = {}
        for device in {rows.device for _, _, _, rows in records if rows is not None}:
            host[device] = iter(torch.cat([rows for *_, rows in records
                                           if rows is not None and rows.device == device]).tolist())
        for module, entries, dtypes, rows in records:
            if self._stop_pending:
                return
            sources = self._reads.host([next(host[rows.device]) for _ in dtypes]) if rows is not None else _NO_ROWS
            call = self._state.count(module is self.model)
            self._queue.append((call, module, entries, dtypes, sources, FORWARD, None))
            if self._decides_now(call):
                self.flush()


def _integer(value, name, expected):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}") from None


def _usable_backend(backend):
    """The backend the detector will ask for: a named backend that cannot run here warns once
    and gives way to the default choice, rather than failing every hook into a slow fallback."""
    backend = check_backend_name(backend)
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


def watch(model, **options):
    """The detector with the recommended modern defaults: no host sync in any hook
    (``check="batch"``), keyword inputs, tensors inside model outputs and containers, and
    gradient checks in backward (a nan/inf there raises before ``backward()`` returns, so the
    optimizer never applies it). Any option of ``DebugUnderflowOverflow`` overrides these.
    Returns the detector: ``remove()`` it, or use it as a context manager."""
    return DebugUnderflowOverflow(model, **{**WATCH_DEFAULTS, **options})
