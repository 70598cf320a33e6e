"""The drop-in ``DebugUnderflowOverflow``: the reference's face, its options, and the hook entry
points. Every module's forward records a frame of statistics per call, and the last frames are
printed when a nan/inf appears.

It reproduces transformers' detector byte for byte, but each call's tensors are read by one
``tensor_stats`` call in the hook (``reads``), the ring keeps raw numbers (text is built only when
printed), and with ``check="batch"`` no hook waits for the device: the rows are brought to the
host once, when the pass ends (``passes``), and the calls are then replayed through the
reference's state machine (``reference``) in order (``decisions``); what a detection does next is
the ``on_detect`` strategy's (``on_detect``).
"""

import copy
import os
import sys
import warnings
import weakref
from typing import Any, Iterable, Literal, Optional

import torch
from torch.compiler import is_compiling

from . import text
from .. import _compat
from .counting import Counting
from .decisions import Decisions
from .early_warnings import EarlyWarnings
from .errors import OverflowDetected, OverflowDetectedOnRanks, say  # noqa: F401 - the package's names
from .frames import BACKWARD, FORWARD, entries_of, graph_task_id, recomputing, transform_level
from .gradients import GradientHooks
from .on_detect import kind as on_detect_kind
from .options import (WATCH_DEFAULTS, Backend, BatchNumbers, Check, Folder, LogTargets, OnDetect,  # noqa: F401
                      Patterns, Seconds, integer, of_arguments)  # (WATCH_DEFAULTS: the integrations')
from .passes import Passes, PassState
from .reference import ReferenceState
from .reference_face import ReferenceFace, detect_overflow, get_abs_min_max  # noqa: F401 - the package's names
from .step_guard import StepGuard, StepMode
from .step_log import StepLog
from ..stats import cpu_backend
from ..stats.dispatch import backend_status, requested_backend


class DebugUnderflowOverflow(ReferenceFace, StepMode):
    """Detect the first inf/nan in a model's weights, inputs and outputs, and print the frames
    that led to it. Same arguments, attributes, text and errors as
    ``transformers.debug_utils.DebugUnderflowOverflow``, plus the options of ``docs/options.md``
    (all off by default; ``watch()`` turns on the recommended ones), ``set_step(global_step,
    mode)`` (the trainer's optimizer step and "train"/"eval", carried by detections, errors,
    records and the report's ``Step:`` line), and ``remove()`` (or use as a context manager),
    which takes the hooks off again."""

    def __init__(self, model: torch.nn.Module, max_frames_to_save: Optional[int] = 21,
                 trace_batch_nums: BatchNumbers = None, abort_after_batch_num: Optional[int] = None,
                 check: Check = "module", frames_every: Optional[int] = None, backend: Backend = None,
                 buffer_rows: int = 1 << 16, reuse_stats: bool = True, kwargs: bool = False, containers: bool = False,
                 backward: bool = False, on_detect: OnDetect = "raise", ignore: Patterns = (),
                 warn_above: Optional[float] = None, sync: bool = True, sync_timeout: Seconds = None,
                 log: LogTargets = None, log_every: int = 1, defer: bool = False, stage_bytes: int = 256 << 20,
                 max_skips: int = 10, warn_gradients: bool = False, find_op: bool = False, repro: Folder = None,
                 min_loss_scale: float = 1.0, max_backoffs: int = 64, **unknown: Any) -> None:
        # every parameter but the model is an option, as options.Options declares it (defaults too:
        # tests/test_options.py holds them equal)
        self._attach(model, of_arguments(locals(), unknown))

    @classmethod
    def from_options(cls, model, options):
        """The detector of ``options``, an ``options.Options`` validated already (``watch()`` and the
        trainer integrations build one)."""
        detector = cls.__new__(cls)
        detector._attach(model, options)
        return detector

    def _attach(self, model, options, module_names=None, watcher_of=None):
        """Hook ``model``. ``module_names`` and ``watcher_of``: a full detector that check="step"
        attaches for one step (``_watcher``): the names are the guard's model's, and with
        ``watcher_of`` set the root's hooks are left to that guard, which calls them."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # The C++ extension (the CPU kernel, and the hooks' bookkeeping on every device) is loaded
        # now, or built once for this torch and CPU (about a minute, its progress on stderr), rather
        # than inside the first forward.
        cpu_backend.extension()
        self.options = options  # frozen: every option, as validated
        # the reference's attributes
        self._model = model
        self.trace_batch_nums = options.trace_batch_nums
        self.abort_after_batch_num = options.abort_after_batch_num
        self.prefix = text.PREFIX
        self.backend = _usable_backend(options.backend)  # the backend the hooks ask for (None: each device's)
        self._reads_kwargs = options.kwargs  # (the post hook asks at every call)
        self._handles = []
        self._inner = module_names is not None
        self._hooks_root = watcher_of is None
        if module_names is None:
            self.analyse_model()
        else:
            self.module_names = module_names
        self.decisions = _decisions(options, self.module_names)
        # gradient frames: each parameter's gradient, and the gradient arriving at module outputs
        # (check="step" reads the gradients itself, at each backward's end)
        self._gradients = (GradientHooks(model, self.module_names, self._gradient_hook,
                                         self._kept_gradient if options.keeps_calls else None)
                           if options.backward and options.check != "step" else None)
        self._passes = self._new_passes()
        self._made_at = _caller() if watcher_of is None else watcher_of._made_at
        self._removed = False
        if not self._inner:
            _warn_if_hooked(self)
            _warn_unmatched(self.decisions.counting, self.module_names.values())
        self.register_forward_hook()
        if not self._inner:
            _ATTACHED.add(self)

    def _new_passes(self):
        if self.options.check == "step":
            guard = StepGuard(self.options, self.decisions, self.model, self.backend, self._watcher)
            guard.own_hooks = frozenset(handle.id for handle in self._handles)  # (a copy's: its hooks came with it)
            return guard
        return Passes(self.options, self.decisions, self.model, self.backend, self._gradients)

    # the options the hooks read, read-only (``options`` holds them all)
    check = property(lambda self: self.options.check)
    kwargs = property(lambda self: self.options.kwargs)
    containers = property(lambda self: self.options.containers)
    backward = property(lambda self: self.options.backward)

    model = property(lambda self: _unless_gone(self._model), lambda self, value: setattr(self, "_model", value))
    detections = property(lambda self: self.decisions.detections)
    global_step = property(lambda self: self.decisions.global_step)
    mode = property(lambda self: self.decisions.mode)

    def register_forward_hook(self):
        if self.options.check == "step":
            self._register_step_hooks()
            return
        self.model.apply(self._register_forward_hook)

    def _register_forward_hook(self, module):
        # A module shared by two parents is visited twice and so hooked twice, like the reference.
        # Pre hooks count the hooked calls running (a pass ends when the outermost returns); the
        # hooks run even when the call raises (always_call), to end its pass. The model's own is
        # kept out of a torch.compile graph: its eager run replays the traced calls.
        # Every post hook takes the keyword inputs (one hook body, no adapter per call); _after
        # reads them with kwargs=True only.
        if module is self.model and not self._hooks_root:
            return  # check="step"'s guard calls them
        after = self._after_model if module is self.model else self._after
        # (the model's own call's keyword inputs are read first, as its batch, beyond the reference)
        with_kwargs = self.options.keeps_calls or (module is self.model and self.decisions.explain)
        self._handles.append(module.register_forward_pre_hook(self._before, with_kwargs=with_kwargs))
        self._handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))

    # -- additions --------------------------------------------------------------------------

    def remove(self) -> None:
        """Take every hook off the model, after deciding on any call still pending. The detector is done
        then (to watch the model again, make a new one), and holds the model and its modules weakly."""
        _ATTACHED.discard(self)
        self._removed = True
        with self._passes.lock:
            handles, self._handles = self._handles, []
            for handle in handles:
                handle.remove()
            if self._gradients is not None:
                self._gradients.remove()
            try:
                self._passes.close()
            finally:
                _let_go_of_the_model(self)
                if self.decisions.log is not None:
                    self.decisions.log.close()

    def __enter__(self) -> "DebugUnderflowOverflow":
        if self._removed:
            raise RuntimeError(f"overflow_fast: this detector (made at {self._made_at}) was removed (remove(), or "
                               "the end of its with block) and has no hooks: make a new one, e.g. "
                               "`with overflow_fast.watch(model):`")
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.remove()
            return
        try:
            self.remove()
        except ValueError:
            pass  # the report is printed; the error already propagating is the one to see

    def __getstate__(self):
        # deepcopy(model) and torch.save(model) reach the detector through the model's hooks:
        # carry the configuration and the ring, not device buffers or a lock; a copy does not
        # write into the original's log. Calls waiting for their decision cannot be carried (their
        # rows are in the device buffers): mid-pass, refuse, as GradScaler does mid-iteration.
        if self._passes.waiting():
            raise RuntimeError(f"overflow_fast: the detector made at {self._made_at} cannot be copied or pickled "
                               "while a forward or backward pass runs (its calls wait for their decision, "
                               "which a copy cannot carry): copy the model between steps, outside its "
                               "forward and after backward() returns")
        state = {name: value for name, value in self.__dict__.items() if name != "_passes"}
        state["decisions"] = copy.copy(self.decisions)
        state["decisions"].log = None
        return _held_strongly(self, state)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._passes = self._new_passes()
        if not getattr(self, "_removed", False):
            _ATTACHED.add(self)  # a copied model carries the copy's hooks

    def flush(self) -> None:
        """Read the pending statistics of every pass (one host read per device) and replay their
        calls in order. Raises the reference's ValueError if one of them holds a nan/inf."""
        with self._passes.lock:
            self._passes.flush_all()

    def set_batch(self, ids: Optional[Iterable[int]] = None) -> None:
        """The rows of the batch that runs next are these samples: ``ids`` holds one dataset index
        per row (dim 0) of the batch, e.g. the indices a sampler gave; None: unknown. A detection's
        ``Where:`` line and record then name the samples of the rows that hold the nan/inf. Call it
        before each batch's forward (the trainer integrations do, where the data loader can tell)."""
        if ids is not None:
            if isinstance(ids, torch.Tensor):
                if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                    raise TypeError(f"set_batch takes one integer index per row, got a {ids.dtype} tensor of "
                                    f"shape {tuple(ids.shape)}")
                ids = ids.detach().cpu().tolist()  # a host copy: later writes to the user's tensor do not count
            elif isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise TypeError(f"set_batch takes a sequence of integer indices or None, got {type(ids).__name__}")
            ids = tuple(integer(i, "set_batch", "a sequence of integer indices or None") for i in ids)
        with self._passes.lock:
            self.decisions.samples = ids

    def set_step(self, global_step: Optional[int] = None, mode: Optional[Literal["train", "eval"]] = None) -> None:
        """What runs next belongs to the trainer's optimizer step ``global_step`` (an int) and to
        ``mode`` ("train" or "eval"); detections, errors and records carry them. None: unknown."""
        if global_step is not None:
            global_step = integer(global_step, "global_step", "an int >= 0 or None")
            if global_step < 0:
                raise ValueError(f"global_step takes an int >= 0 or None, got {global_step}")
        if mode not in (None, "train", "eval"):
            raise ValueError(f"mode must be 'train', 'eval' or None, got {mode!r}")
        with self._passes.lock:
            if global_step is not None and global_step != self.decisions.global_step:
                self._passes.strategy.new_step()
            self.decisions.global_step, self.decisions.mode = global_step, mode

    # -- the hooks ----------------------------------------------------------------------------

    def _before(self, module, args, kwargs=None):
        if is_compiling():
            return
        self._passes.call_starts(module, args, kwargs, 2)

    def _after_model(self, module, input, kwargs, output):
        self._after(module, input, kwargs, output)

    def _after(self, module, input, kwargs, output):
        try:
            if not self._reads_kwargs:
                kwargs = None
            run = self._passes
            if is_compiling():
                return run.traced.record(module, input, output, kwargs, self.containers, self.backend)
            ambient, kept_call, outermost = run.call_returns(module, input, kwargs)
            error = sys.exception()
            raised = error is not None and error is not ambient  # run by torch because the call raised
            if graph_task_id() != -1 and recomputing():
                # recomputed in backward (activation checkpointing): the backward pass decides it
                if not raised:
                    with run.lock, _functorch_off() as transformed:
                        run.forward_returned(module, input, output, kwargs, True, transformed, kept_call)
                return
            # _functorch_off() without a Python context manager outside transforms (this runs at every hook)
            guard = None if transform_level() is None else _FunctorchOff()
            transformed = guard is not None and guard.__enter__()
            try:
                with run.lock:
                    try:
                        if not raised:
                            run.forward_returned(module, input, output, kwargs, False, transformed, kept_call)
                    except BaseException as failure:
                        if outermost:
                            run.end(run.forward_pass(), FORWARD, failure)
                        raise
                    if outermost:
                        run.end(run.forward_pass(), FORWARD, error if raised else None)
                        if kept_call is not None and not kept_call.grad_enabled:
                            kept_call.release()  # decided: an evaluation keeps nothing
            finally:
                if transformed:
                    guard.__exit__(None, None, None)
        except OverflowDetected as error:
            raise error.with_traceback(None)  # (the report's traceback starts here: the frames below help no reader)

    def _kept_gradient(self, tensor_id, grad):
        """find_op: the gradient arriving at a forward output (its id), kept for the backward's replay."""
        self._passes.keep_gradient(tensor_id, grad)

    def _gradient_hook(self, module, items, consumers):
        try:
            run = self._passes
            guard = None if transform_level() is None else _FunctorchOff()  # (as _after's)
            transformed = guard is not None and guard.__enter__()
            try:
                with run.lock:
                    current = run.backward_pass()
                    if current.state is _STOPPING:
                        return
                    entries, tensors, dtypes = entries_of(items, True) if transformed else run.entries_of.of(items)
                    run.add(current, self.decisions.state.count_backward(), module, entries, dtypes, tensors,
                            BACKWARD, consumers)
                    run.decide_when_backward_ends()
            finally:
                if transformed:
                    guard.__exit__(None, None, None)
        except OverflowDetected as error:
            raise error.with_traceback(None)  # (as _after's)


# A hook that torch.compile meets outside a frame it traces runs eagerly (the module around it ran
# eagerly too), rather than as a graph of its own per call; inlined, it records into the graph.
_compat.never_a_compiled_frame(DebugUnderflowOverflow._before, DebugUnderflowOverflow._after,
                               DebugUnderflowOverflow.forward_hook, StepMode._step_begins)
# The model's own post hooks are kept out of a torch.compile graph (their eager run replays the traced
# calls, and reads the host) as torch.compiler.disable keeps a function out, but without its wrapper,
# whose frame would stand in every report's traceback
_compat.kept_out_of_graphs(DebugUnderflowOverflow._after_model, StepMode._step_ends)


class _FunctorchOff:
    """Inside a torch.func transform, the hook's own work runs with functorch's dispatch off: what
    it allocates stays a plain tensor, and it reads the values under the wrappers
    (``frames.untransformed``). ``as`` gives True: a transform is active."""

    __slots__ = ("guard",)

    def __enter__(self):
        self.guard = torch._C._DisableFuncTorch()
        self.guard.__enter__()
        return True

    def __exit__(self, *exc):
        self.guard.__exit__(*exc)
        return False


class _OutsideTransforms:
    """``_functorch_off()`` outside any torch.func transform (nearly every hook): nothing to turn off."""

    __slots__ = ()

    def __enter__(self):
        return False

    def __exit__(self, *exc):
        return False


_OUTSIDE_TRANSFORMS = _OutsideTransforms()
_STOPPING = PassState.STOPPING


def _functorch_off():
    """The context a hook's own work runs in: functorch's dispatch off inside a transform."""
    return _OUTSIDE_TRANSFORMS if transform_level() is None else _FunctorchOff()


def _unless_gone(model):
    """``model``, the reference's attribute: once removed, held weakly (None once it is gone)."""
    return model() if isinstance(model, weakref.ref) else model


def _held_strongly(detector, state):
    """A copy's state carries the model and its names, not a removed detector's weak references."""
    state["_model"], state["module_names"] = detector.model, dict(detector.module_names)
    state["decisions"].module_names = state["module_names"]
    return state


def _let_go_of_the_model(detector):
    """A removed detector holds its model, and names its modules, weakly."""
    model = detector.model
    detector._model = weakref.ref(model) if model is not None else None
    detector.module_names = weakref.WeakKeyDictionary(detector.module_names)
    detector.decisions.module_names = detector.module_names


# Detectors whose hooks are on a model (not removed), to warn when a second one joins them.
_ATTACHED: "weakref.WeakSet[DebugUnderflowOverflow]" = weakref.WeakSet()


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside_frames():
    """``(frame, depth)`` of the innermost frame outside this package (the user's code that made a
    detector, or the trainer that did), ``depth`` counted from the caller of this function."""
    frame, depth = sys._getframe(1), 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, depth = frame.f_back, depth + 1
    return frame, depth


def _caller():
    """``file:line`` of the code that made a detector."""
    frame, _ = _outside_frames()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def _warn_if_hooked(detector):
    """A second detector on a model (or on some of its modules) doubles their hooks: say so, naming
    the first."""
    mine = {id(module) for module in detector.module_names}
    for other in list(_ATTACHED):
        shared = sum(1 for module in other.module_names if id(module) in mine)
        if not shared or other is detector:
            continue
        what = "this model" if shared == len(mine) else f"{shared} of this model's {len(mine)} modules"
        warnings.warn(f"overflow_fast: a detector is already attached to {what}: the one made at {other._made_at}, "
                      "not removed. This one adds its own hooks, so each of those modules' calls is read twice (twice "
                      "the cost); a nan/inf is reported once, by the first to meet it. remove() the first (or use one as a context manager: "
                      "`with overflow_fast.watch(model):`)", RuntimeWarning, stacklevel=_outside_frames()[1] + 1)
        return


def _decisions(options, module_names):
    """What replays a detector's calls through the reference's state machine (``decisions``), as
    its options say."""
    log = StepLog(options.log, options.log_every, options.check) if options.log is not None else None
    # the Where and Source lines only where the frames already go beyond the reference's: the
    # drop-in without kwargs, containers or backward prints the reference's text alone
    beyond_reference = options.kwargs or options.containers or options.backward
    strategy = on_detect_kind(options.on_detect)
    return Decisions(
        ReferenceState(options.max_frames_to_save, options.trace_batch_nums),
        Counting(strategy.reports, strategy.once_per, options.ignore),
        EarlyWarnings(options.warn_above, options.warn_gradients) if options.warn_above is not None else None,
        log, module_names, beyond_reference, rewinds=strategy.rewinds)


def _warn_unmatched(counting, module_names):
    """An ``ignore`` pattern that matches no module of the model is a typo until shown otherwise."""
    for pattern, near in counting.unmatched(module_names):
        hint = f" (did you mean {near!r}?)" if near is not None else ""
        warnings.warn(f"overflow_fast: ignore={pattern!r} matches no module of this model{hint}: it ignores nothing",
                      RuntimeWarning, stacklevel=_outside_frames()[1] + 1)


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


def watch(model: torch.nn.Module, *, max_frames_to_save: Optional[int] = 21, trace_batch_nums: BatchNumbers = None,
          abort_after_batch_num: Optional[int] = None, check: Check = "batch", frames_every: Optional[int] = None,
          backend: Backend = None, buffer_rows: int = 1 << 16, reuse_stats: bool = True, kwargs: bool = True,
          containers: bool = True, backward: bool = True, on_detect: OnDetect = "raise", ignore: Patterns = (),
          warn_above: Optional[float] = None, sync: bool = True, sync_timeout: Seconds = None,
          log: LogTargets = None, log_every: int = 1, defer: bool = False, stage_bytes: int = 256 << 20,
          max_skips: int = 10, warn_gradients: bool = False, find_op: bool = True, repro: Folder = None,
          min_loss_scale: float = 1.0, max_backoffs: int = 64, **unknown: Any) -> "DebugUnderflowOverflow":
    """The detector with the recommended modern defaults (``options.WATCH_DEFAULTS``): no host sync
    in any hook (``check="batch"``), keyword inputs, tensors inside model outputs and containers,
    gradient checks in backward (a nan/inf there raises before ``backward()`` returns, so the
    optimizer never applies it; under a GradScaler, one it recovers from is its backoff, a line),
    and the op and the line of a detection (``find_op``).
    Every option is ``DebugUnderflowOverflow``'s (``docs/options.md``).
    Returns the detector: ``remove()`` it, or use it as a context manager."""
    return DebugUnderflowOverflow.from_options(model, of_arguments(locals(), unknown))
