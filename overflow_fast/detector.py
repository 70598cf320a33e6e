"""The drop-in ``DebugUnderflowOverflow``: a forward hook on every module records a frame of
statistics per call, and the last frames are printed when a nan/inf appears.

It reproduces transformers' detector byte for byte, but each frame's statistics come from one
``tensor_stats`` call, the ring keeps raw numbers (text is built only when printed), and with
``check="batch"`` no hook waits for the device: statistics go to a preallocated device buffer
that is read once, at the end of the top-level forward.
"""

import collections
import operator
import sys
import threading
import warnings

import torch
from torch.compiler import is_compiling

from . import distributed, report
from .frames import (BACKWARD, FORWARD, Frame, class_name, entries_of, forward_frame, forward_items, hook_frame,
                     make_call)
from .flight import StepLog
from .gradients import GradientHooks
from .policy import Policy, is_bad, source_line
from .report import NONE, NOT_A_TENSOR, TENSOR, UNREADABLE
from .reuse import ReuseCache
from .rows import DEFAULT_STAGE_BYTES, DeferredRows, RowReader, resolve
from .stats import tensor_stats, unreadable_reason
from .stats.dispatch import backend_status, check_backend_name, requested_backend

CHECK_MODES = ("module", "batch")
_TRACE_MODE = operator.attrgetter("trace_mode")
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
_inference_mode = torch.is_inference_mode_enabled
DEFAULT_BUFFER_ROWS = 1 << 16


class OverflowDetected(ValueError):
    """The reference's ValueError on a detected inf/nan (same message, so ``except ValueError``
    and the text hold), carrying what was detected as data for a trainer to log or checkpoint:
    ``batch_number``, ``phase``, ``module_name``, ``class_name``, ``entries`` (of the first frame
    holding a nan/inf), ``rank`` (None in a single process), ``detection`` (those as a dict) and
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


class DebugUnderflowOverflow:
    """Detect the first inf/nan in a model's weights, inputs and outputs, and print the frames
    that led to it. Same arguments, attributes, text and errors as
    ``transformers.debug_utils.DebugUnderflowOverflow``, plus:

    - ``check="module"`` (default) decides at each module, as the reference does, with one host
      sync per hook; ``check="batch"`` never syncs in a hook and decides once per forward of the
      top-level model (or when its buffer fills), printing exactly the same report.
    - ``backend``: the ``tensor_stats`` backend (None picks the fastest per device).
    - ``reuse_stats``: within one forward, a tensor already read (the same object, its version
      counter unchanged, e.g. one module's output and the next one's input) is not read again.
      Turn it off if tensors are written through aliases that bypass the version counter.
    - ``buffer_rows``: rows of the device buffer of ``check="batch"`` (read early when full).
    - ``stage_bytes``: with ``check="batch"``, a forward's hooks only stage their tensors, which
      are read together when it ends; staged tensors stay alive until then, so once this many
      bytes of tensors outside autograd (which keeps a training forward's activations until
      backward anyway) wait, they are read at once (no host sync). 0 reads each hook's tensors
      in the hook.
      Staging relies on version counters, as ``reuse_stats`` does: it is off without it.
    - ``kwargs``: keyword tensor inputs get lines too (``input[hidden_states]``); the reference
      sees positional inputs only.
    - ``containers``: tensors inside dicts, lists, ModelOutputs, dataclasses and nested tuples get
      lines named by their path (``output[loss]``) instead of one ``not a tensor`` line.
    - ``remove()`` and use as a context manager take the hooks off again.
    """

    def __init__(self, model, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None,
                 check="module", backend=None, buffer_rows=DEFAULT_BUFFER_ROWS, reuse_stats=True,
                 kwargs=False, containers=False, backward=False, on_detect="raise", ignore=(),
                 warn_above=None, sync=True, sync_timeout=None, log=None, log_every=1,
                 stage_bytes=DEFAULT_STAGE_BYTES):
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
        if isinstance(buffer_rows, bool) or not isinstance(buffer_rows, int) or buffer_rows < 1:
            raise ValueError(f"buffer_rows must be a positive int, got {buffer_rows!r}")
        if isinstance(stage_bytes, bool) or not isinstance(stage_bytes, int) or stage_bytes < 0:
            raise ValueError(f"stage_bytes must be a non-negative int, got {stage_bytes!r}")

        self.model = model
        self.trace_batch_nums = trace_batch_nums
        self.abort_after_batch_num = abort_after_batch_num
        self.check = check
        self.backend = _usable_backend(backend)
        self.reuse_stats = bool(reuse_stats)
        self.kwargs = bool(kwargs)
        self.containers = bool(containers)
        self.backward = bool(backward)
        self._stages = check == "batch" and self.reuse_stats  # a forward's hooks stage their tensors
        self._policy = Policy(on_detect, ignore, warn_above)
        # beyond the drop-in, a report ends with the line saying where the values were born
        self._explain = self.kwargs or self.containers or self.backward
        self.detections = []  # what was detected: batch_number, phase, module, class, entries
        # under torch.distributed: every rank stops together at the end of the forward or backward
        # pass in which any rank detected (see overflow_fast.distributed for the hazards)
        self.sync = bool(sync)
        self.sync_timeout = sync_timeout
        self._stop_pending = False  # this rank detected; the error waits for the agreement
        self._log = StepLog(log, log_every) if log is not None else None  # the flight recorder
        self._forward_depth = 0  # top-level forwards running

        # The reference swaps its deque for an unbounded list after tracing or a dump; this stays bounded.
        self.frames = collections.deque([], max_frames_to_save)
        self.frame = []
        self.batch_number = 0
        self.total_calls = 0
        self.detected_overflow = False
        self.prefix = report.PREFIX
        self._first_bad = None  # (frame, entries) of the first non-finite frame not yet reported
        self._report_due = False  # on_detect="warn": a (module, entry) not reported before
        self._reported_pass = None  # on_detect="warn"/"record": (phase, batch) already detected

        self._handles = []
        self._traced = []  # records of hooks traced by torch.compile, not replayed yet
        # the calls of the last clean read and the frames its replay pushed out of the ring, freed
        # when the next forward starts: on a GPU freeing a forward's frames right after its host
        # read would keep the device idle that long
        self._spent = None
        self._buffer_rows = buffer_rows
        self._stage_bytes = stage_bytes
        self._new_readers()
        self._lock = threading.RLock()  # hooks may run on several threads
        self._backward_flush_task = None  # the backward pass whose end will flush (check="batch")
        self._gradients = None
        self.analyse_model()
        self.register_forward_hook()

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
        # flushed: a rank killed by its launcher right after the ValueError must leave its report
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
        """Build, check and save the frame of one hook call right away (one host sync)."""
        frame, tensors = forward_frame(self.module_names.get(module, "?"), module, input, output)
        self._reader.read_now(frame, tensors)
        self._save(frame)

    def register_forward_hook(self):
        self.model.apply(self._register_forward_hook)
        if self.backward:
            self._gradients = GradientHooks(self.model, self.module_names, self._gradient_hook)
        # The top-level forward bounds the reuse cache; always_call: its end runs even when the
        # forward raises, so the cache closes and pending checks still print.
        self._handles.append(self.model.register_forward_pre_hook(self._before_forward))
        self._handles.append(self.model.register_forward_hook(self._after_forward, always_call=True))

    def _register_forward_hook(self, module):
        # a module shared by two parents is visited twice and so hooked twice, like the reference
        if self.kwargs:
            self._handles.append(module.register_forward_hook(self._forward_hook_with_kwargs, with_kwargs=True))
        else:
            self._handles.append(module.register_forward_hook(self.forward_hook))

    def forward_hook(self, module, input, output):
        if is_compiling():
            return self._traced_hook(module, input, output)
        with self._lock:
            self._forward_hook(module, input, output)

    def _forward_hook_with_kwargs(self, module, input, kwargs, output):
        if is_compiling():
            return self._traced_hook(module, input, output, kwargs)
        with self._lock:
            self._forward_hook(module, input, output, kwargs)

    # -- additions --------------------------------------------------------------------------

    def remove(self):
        """Take every hook off the model, after running any check still pending."""
        with self._lock:
            handles, self._handles = self._handles, []
            for handle in handles:
                handle.remove()
            if self._gradients is not None:
                self._gradients.remove()
            self._reuse.reset()
            try:
                self.flush()  # its records and detection still reach the log
            finally:
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
        # carry the configuration and the ring, not device buffers, caches or a lock
        state = self.__dict__.copy()
        for name in ("_reuse", "_reader", "_deferred", "_lock"):
            del state[name]
        state.update(_first_bad=None, _backward_flush_task=None, _stop_pending=False, _forward_depth=0,
                     _spent=None, _log=None, _traced=[])  # a copy does not write into the original's log
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._new_readers()
        self._lock = threading.RLock()

    def flush(self):
        """Read the pending statistics (one host sync per device) and replay their calls in order.

        Raises the reference's ValueError if one of them holds a nan/inf.
        """
        with self._lock:
            if not self._deferred:
                return
            # frames that will only pass through the ring need no rows unless a nan/inf shows up
            # (nothing traced, logged or warned about needs every frame)
            lazy = (self._log is None and self._policy.warn_above is None and not self.detected_overflow
                    and not any(map(_TRACE_MODE, self._deferred.pending)))
            calls, finite_rows = self._deferred.read(lazy=lazy)
            if finite_rows is not None:
                self._spent = (calls, list(self.frames))
                self._replay_finite(calls, finite_rows)
                return
            for call in calls:
                self._replay(call)  # raises at the first bad call: those after it never happened

    # -- internals --------------------------------------------------------------------------

    def _new_readers(self):
        self._reuse = ReuseCache(self.reuse_stats)  # rows read in this top-level forward
        self._reader = RowReader(self.backend, self._reuse)
        self._deferred = DeferredRows(self._reader, self._buffer_rows, self._stage_bytes)  # check="batch"

    def _forward_hook(self, module, input, output, kwargs=None):
        if self._traced:
            self._absorb_traced()  # a compiled region ran before this call
        if self._stop_pending:
            return  # this rank reported; it stops with the others at the end of this pass
        frame, tensors = hook_frame(self.module_names, module, input, output, kwargs, self.containers)
        batch = self.batch_number
        if (self._stages and self._forward_depth and not self.detected_overflow and batch not in self.trace_batch_nums
                and _graph_task_id() == -1 and not _inference_mode()):
            # check="batch" inside a top-level forward, nearly every hook: `_call` and `_check`'s
            # staging branch inlined (two Python calls and their tests are a tenth of a hook)
            self.total_calls = total = self.total_calls + 1
            last = module is self.model
            if last:
                self.batch_number = batch + 1
            call = make_call(frame, False, total == 1, last, batch, batch + last, total)
            if self._gradients is not None:
                self._gradients.watch_outputs(module, frame, tensors)
            deferred = self._deferred
            if not deferred.stage(call, tensors, module):
                if deferred.must_read_before(tensors):
                    self.flush()
                deferred.add(call, tensors, module)
            if last:
                self.flush()
        else:
            call = self._call(module, frame)
            if self._gradients is not None:
                self._gradients.watch_outputs(module, frame, tensors)
            self._check(call, tensors, module)
        if self._abort_after is not None:
            self._abort_if_due()

    def _call(self, module, frame):
        """The reference's bookkeeping of one forward hook call."""
        trace_mode = self.batch_number in self.trace_batch_nums
        first_call = self.total_calls == 0
        batch_before = self.batch_number
        self.total_calls += 1
        last_frame_of_batch = module is self.model
        if last_frame_of_batch:
            self.batch_number += 1
        return make_call(frame, trace_mode, first_call, last_frame_of_batch, batch_before, self.batch_number,
                         self.total_calls)

    def _abort_if_due(self):
        if self._abort_after is not None and self.batch_number > self._abort_after:
            self.flush()
            raise ValueError(report.abort_error(self.batch_number, self.abort_after_batch_num))

    # -- under torch.compile ----------------------------------------------------------------
    #
    # While dynamo traces a model, a forward hook must neither take the lock, nor read the
    # detector's counters (each value read would become a guard, and every batch a recompile),
    # nor sync. It only computes its rows inside the graph (one engine op node) and records the
    # frame's static entries; the records are replayed through the reference's state machine by
    # the first eager hook after the compiled region, or by the end of the top-level forward
    # (``_after_forward``, kept out of the graph: the forward's one graph break).

    def _traced_hook(self, module, input, output, kwargs=None):
        entries, tensors, dtypes = entries_of(forward_items(module, input, output, kwargs, self.containers))
        rows = tensor_stats(tensors, self.backend).values if tensors else None
        self._traced.append((module, entries, dtypes, rows))

    def _absorb_traced(self):
        """Replay the records of a compiled region: one host read per device for all of them."""
        records = list(self._traced)
        self._traced.clear()  # the same list: its identity is a guard of the compiled graph
        host = {}
        for device in {rows.device for _, _, _, rows in records if rows is not None}:
            same = [rows for _, _, _, rows in records if rows is not None and rows.device == device]
            host[device] = iter(torch.cat(same).tolist())
        for module, entries, dtypes, rows in records:
            if self._stop_pending:
                return
            frame = Frame(self.module_names.get(module, "?"), class_name(module), list(entries), dtypes)
            frame.rows = [next(host[rows.device]) for _ in dtypes] if rows is not None else []
            self._check(self._call(module, frame), None)
            self._abort_if_due()

    def _check(self, call, tensors, module=None):
        """Decide now (check="module", traced batches, after a detection) or queue the call.

        ``tensors`` None: the frame's rows are on the host already (a compiled graph's).
        ``module``: a forward hook's module. Inside a top-level forward its tensors are staged
        (read when the forward ends); elsewhere (backward, a submodule driven alone, inference
        mode, whose tensors keep no version counter) they are read in the hook, without a sync."""
        in_backward = _graph_task_id() != -1
        if self.check == "batch" and not call.trace_mode and not self.detected_overflow:
            if self._deferred.must_read_before(tensors):
                self.flush()  # a full buffer is read early (a submodule run alone still gets checked)
            stage = (module is not None and self._forward_depth > 0 and self.reuse_stats and not in_backward
                     and not _inference_mode())
            self._deferred.add(call, tensors, module if stage else None)
            if call.last_frame_of_batch:
                self.flush()
        else:
            self.flush()  # earlier calls first: one of them may be the first bad one
            if tensors is not None:
                self._reader.read_now(call.frame, tensors)
            self._replay(call)
        if in_backward and (self.check == "batch" or self._sync_wanted()):
            self._flush_when_backward_ends()

    def _gradient_hook(self, frame, tensors):
        with self._lock:
            if self._stop_pending:
                return
            # a backward pass belongs to the batch whose forward ran last
            trace_mode = (self.batch_number - 1) in self.trace_batch_nums
            call = make_call(frame, trace_mode, False, False, self.batch_number, self.batch_number, self.total_calls)
            self._check(call, tensors)

    def _before_forward(self, module, input):
        if is_compiling():
            return
        with self._lock:
            self._spent = None
            self._forward_depth += 1
            self._reuse.open()
            if self._gradients is not None:
                self._gradients.new_forward()

    @torch.compiler.disable
    def _after_forward(self, module, input, output):
        # Reached with work pending (check="batch") only when the forward raised: print the
        # report, let that error propagate.
        with self._lock:
            if self._traced:
                self._absorb_traced()
            self._forward_depth = max(0, self._forward_depth - 1)
            self._reuse.close()
            try:
                self._finish_forward()
            finally:
                if self._forward_depth == 0 and self._sync_wanted():
                    self._agree()

    def _finish_forward(self):
        if self._deferred:
            error = sys.exc_info()[1]  # the forward's own error, being handled by torch
            if isinstance(error, OverflowDetected):
                # another detector on this model reported first; check="module" would never have
                # reached the frames still pending here
                self._deferred.discard()
                return
            try:
                self.flush()
            except ValueError:
                if error is None:
                    raise
                # torch would silence (with a warning) what a hook raises here: annotate its error
                if hasattr(error, "add_note"):
                    error.add_note("overflow_fast: an inf/nan was detected earlier in this forward; "
                                   "its report is printed above")

    def _flush_when_backward_ends(self):
        """Hooks running inside a backward pass (checkpointing recomputes modules there): decide
        when the pass ends, before ``backward()`` returns and so before the optimizer step."""
        task = _graph_task_id()
        if self._backward_flush_task == task:
            return
        self._backward_flush_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._flush_after_backward)

    def _flush_after_backward(self):
        with self._lock:
            self._backward_flush_task = None
            try:
                self.flush()
            finally:
                if self._sync_wanted():
                    self._agree()

    def _sync_wanted(self):
        """Whether this detector's decisions are agreed between ranks (see overflow_fast.distributed)."""
        return (self.sync and self._policy.on_detect == "raise" and distributed.world() is not None
                and not distributed.is_local_only())

    def _in_pass(self):
        """Inside a forward of the top-level model or a backward pass: where every rank meets."""
        return self._forward_depth > 0 or _graph_task_id() != -1

    def _agree(self):
        """One small collective: every rank learns which ranks detected; all raise together."""
        pending, self._stop_pending = self._stop_pending, False
        ranks = distributed.agree(bool(pending), timeout=self.sync_timeout)
        if ranks:
            self.detected_overflow = True
            raise OverflowDetectedOnRanks(ranks, distributed.world()[1], *(pending or ()))

    def _replay(self, call):
        """The reference's bookkeeping for one hook call whose rows are on the host."""
        frame = call.frame
        if call.trace_mode:
            self.reset_saved_frames()
        if call.first_call:
            self.frame.extend(report.batch_start_lines(call.batch_before))
        # the batch a frame belongs to: a backward pass runs after its forward counted the batch
        batch = call.batch_before - 1 if frame.phase == BACKWARD else call.batch_before
        self._save(frame, batch)
        if self._log is not None:
            self._log.frame(frame, batch)
        if call.trace_mode:
            # the reference's ring holds just this frame now, whatever max_frames_to_save says
            _print(str(frame))
            self.frames.clear()
        if call.last_frame_of_batch:
            self.frame.extend(report.batch_start_lines(call.batch_after))
        if self.detected_overflow and not call.trace_mode:
            if self._policy.on_detect == "raise":
                # with check="batch" later calls may have run: they never happened, report the
                # state of this one
                self.batch_number = call.batch_after
                self.total_calls = call.total_calls
            self._detected(frame, batch, call.batch_after)

    def _replay_finite(self, calls, values):
        """``_replay`` of calls none of whose rows counts a nan/inf, with nothing to trace, warn
        or log: only the ring and the pending batch lines change, and the ring keeps the last
        frames alone, so only those get their host rows (``values``: every slot's, a flat
        memoryview; only the rows the kept frames name become Python ints)."""
        keep = self.frames.maxlen
        first_kept = 0 if keep is None else max(0, len(calls) - keep)
        # Frames the ring would drop matter only through the batch lines still pending after
        # them: those after the last forward frame among them (a forward frame takes the
        # pending lines as its lead), so the replay starts there.
        start = first_kept - 1
        while start >= 0 and calls[start].frame.phase != FORWARD:
            start -= 1
        ring = self.frames
        for index in range(max(start, 0), len(calls)):
            call = calls[index]
            frame = call.frame
            if call.first_call:
                self.frame.extend(report.batch_start_lines(call.batch_before))
            if frame.phase == FORWARD:
                frame.lead, self.frame = self.frame, []
            if index >= first_kept:
                resolve(frame, values)
                ring.append(frame)
            if call.last_frame_of_batch:
                self.frame.extend(report.batch_start_lines(call.batch_after))

    def _save(self, frame, batch=None):
        """Attach the pending lead lines, print the nan/inf lines, keep the frame in the ring."""
        if frame.phase == FORWARD:  # backward frames leave the next batch's markers where they are
            frame.lead, self.frame = self.frame, []
        policy = self._policy
        for kind, ctx, payload in frame.entries:
            if kind == TENSOR and is_bad(frame.rows[payload]):
                if policy.ignore and policy.ignored(frame.module_name, ctx):
                    continue
                if policy.on_detect != "raise" and self._reported_pass == (frame.phase, batch):
                    policy.new_reports(frame, [ctx])  # a consequence of what this pass reported
                    continue
                if self._first_bad is None:
                    self._first_bad = (frame, [])  # where the source line looks
                if self._first_bad[0] is frame:
                    self._first_bad[1].append(ctx)
                # on_detect="warn": each (module, entry) once
                if policy.on_detect == "raise" or (
                        policy.on_detect == "warn" and policy.new_reports(frame, [ctx])):
                    for line in report.overflow_lines(frame.rows[payload], ctx):
                        _print(line)
                    if frame.bad_shards and payload in frame.bad_shards:  # a DTensor: whose shard holds them
                        _print(report.bad_shards_line(ctx, frame.bad_shards[payload]))
                    self._report_due = True
                self.detected_overflow = True
        if policy.warn_above is not None:
            for line in policy.early_warnings(frame, batch):
                _print(line)
        self.frames.append(frame)

    def _detected(self, frame, batch, shown_batch):
        """A nan/inf counted in ``frame`` (or earlier, in a traced batch): report it as on_detect says."""
        first_frame, bad = self._first_bad or (frame, [])
        self._first_bad = None
        detection = {"batch_number": batch, "phase": first_frame.phase,
                     "module": first_frame.module_name, "class": first_frame.class_name, "entries": bad}
        self.detections.append(detection)
        if self._log is not None:
            self._log.detection(detection)
        report_due, self._report_due = self._report_due, False
        on_detect = self._policy.on_detect
        if on_detect == "raise":
            self._deferred.discard()
            frames = [report.frame_data(f) for f in self.frames if not isinstance(f, str)]
            self._dump(frame, first_frame, bad, batch, shown_batch)
            if self._sync_wanted() and self._in_pass():
                # the other ranks are mid-pass, inside their own collectives (DDP, FSDP2, tensor
                # parallel): stop with them at the end of this pass, not here
                self._stop_pending = (detection, frames)
                return
            raise OverflowDetected(report.OVERFLOW_ERROR, detection, frames)
        self.detected_overflow = False  # go on: later batches are checked afresh
        # later frames of this forward or backward only pass the values on: one detection a pass
        self._reported_pass = (frame.phase, batch)
        if on_detect == "warn" and report_due:
            self._dump(frame, first_frame, bad, batch, shown_batch)
            warnings.warn(f"overflow_fast: inf/nan in {first_frame.module_name or '(model)'} "
                          f"{', '.join(bad)} ({first_frame.phase}, batch_number={detection['batch_number']}); "
                          "training goes on (on_detect='warn')", RuntimeWarning, stacklevel=2)
        self.frames.clear()

    def _dump(self, frame, first_frame, bad, batch, shown_batch):
        """The reference's report (its batch number is the one its state had at that call)."""
        during = f"the backward of batch_number={batch}" if frame.phase == BACKWARD else f"batch_number={shown_batch}"
        self.dump_saved_frames(during)
        if self._explain and bad:
            _print(source_line(first_frame, bad))


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
