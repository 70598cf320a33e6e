"""With ``find_op``: which call a detection's replay runs (``op_replay`` replays it), and what it finds.

With ``find_op`` each hooked call keeps references (never copies) to its inputs, until its pass
ends, or, for a forward with autograd on (the recompute of a reentrant checkpoint too), until the
backward pass that follows it ends (the backward's replay runs that forward again). The outermost
call of a pass also keeps the RNG states at its start, once per pass. A detection born in a module's
forward or backward is then replayed: that one call alone, every op's outputs checked
(``op_replay``), and the first op that made a nan/inf from finite inputs is named with the line of
code that ran it.

Which call:
- born in a module's forward: that call. Its replay runs on the very inputs of the run, so it also
  tells a deterministic nan/inf (``reproduced``) from a transient fault (finite where the run's
  was not, and the run's values everywhere else). Where its ``forward`` is torch's own
  (``nn.Linear``), the line is found by replaying the nearest enclosing call whose ``forward`` is
  someone else's code, up to that module's call: the op's frame is the line that calls the module.
  Without one, the line names no line of code but the module whose torch code ran it.
- in the code between two modules (``before``): the enclosing call, up to the module's call.
- in backward: the consumer's call with the gradient that arrived at its outputs; where no single
  module consumes the gradient (the parent's own code does), the enclosing call's.
- a module inside a ``torch.compile`` region keeps no inputs (its hooks are traced): the nearest
  enclosing call that ran eagerly is replayed, eagerly.
Random ops replay exactly: the replay starts from the RNG states the call started with, found by
running the pass again from its start (where the states were taken) up to that call, nothing read.
The same run brings back inputs that changed in place since the call, or that hold objects which
may have changed unseen (a transformers cache the call appended to). Where that cannot be done,
random ops draw afresh and the line says so. A data-parallel wrapper's call (DDP) is never
replayed: the pass starts at the call of the module it wraps.

Under no_grad (and inference mode) autograd keeps nothing, and neither does a call once it
returned (``release``): only the calls still running keep their inputs, so a pass holds no more
than it would without find_op. A released call is replayed through its nearest enclosing call
that kept its inputs (the outermost one, at the end of a pass), up to that call.
"""

import torch

from .sandbox import holds_objects


_AUTOCAST_DEVICES = ("cpu", "cuda")
CHANGED = "not reproduced on replay (the module's inputs changed in place after its hook)"


class KeptCall:
    """One hooked call as its replay needs it: the module, its positional and keyword inputs
    (references), their versions when it started (``versions_of``), the call it ran in, its grad
    mode, the autocast of its forward (``autocast_state``, taken once per forward) and its output.
    ``root`` is the outermost call of its pass (below a data-parallel wrapper: the call of the
    module it wraps), which keeps ``root_state(module, outermost)``: the RNG states at its start
    (``rng``; None for a call seen only as it ended: ``root_state_at_end``) and whether it is a
    data-parallel wrapper (``wraps``); ``ordinal`` counts the module's earlier calls under the
    root (a replay from the root finds this one by it).

    The specification of csrc/hooks.cpp's KeptCall, which the hooks use where the extension loads
    (``hook_core.kept_call_class``): the same fields by the same rules, and the same methods."""

    __slots__ = ("module", "args", "kwargs", "versions", "parent", "grad_enabled", "autocast", "_output",
                 "output_versions", "_root", "rng", "counts", "ordinal", "wraps", "kept")

    def __init__(self, module, args, kwargs, parent, autocast, root_state):
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.versions = versions_of(args, kwargs)
        self.parent = parent
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = autocast
        self._output = self.output_versions = None
        self.kept = True  # False once released
        if parent is None or parent.wraps:
            self._root, self.counts = None, {}  # (not itself: no reference cycle keeps a call alive)
            self.rng, self.wraps = root_state(module, parent is None)
            root = self
        else:
            root = parent if parent._root is None else parent._root
            self._root, self.counts, self.rng, self.wraps = root, None, None, False
        if parent is not None and parent.module is module:  # one call hooked twice (a module under two parents)
            self.ordinal = parent.ordinal
        else:
            counts = root.counts
            self.ordinal = counts.get(id(module), 0)
            counts[id(module)] = self.ordinal + 1

    def returned(self, output):
        """The call's output, as it returned, and its tensors' versions then (one level deep)."""
        self._output = output
        self.output_versions = versions_of(_items(output), None)

    @property
    def root(self):
        return self if self._root is None else self._root

    @property
    def output(self):
        return self._output

    def release(self):
        """Let go of the inputs and output: a replay runs the nearest enclosing call that kept them."""
        self.args = self.kwargs = self._output = self.output_versions = None
        self.kept = False

    def changed(self):
        """Whether an input changed in place since the call started."""
        return versions_of(self.args, self.kwargs) != self.versions

    def output_changed(self):
        """Whether the output changed in place since the call returned."""
        return versions_of(_items(self._output), None) != self.output_versions

    def call_state(self):
        """What the replay runs under (``op_replay.call_state``'s form)."""
        return {"grad_enabled": self.grad_enabled, "autocast": self.autocast}


def root_state(module, outermost):
    """(rng, wraps) of the root of a pass: the RNG states at its start, and whether it is a
    data-parallel wrapper (only the outermost call can be one)."""
    return _rng_state(), outermost and is_wrapper(module)


def root_state_at_end(module, outermost):
    """``root_state`` of a call seen only as it ended: its RNG states at its start are unknown."""
    return None, outermost and is_wrapper(module)


def _items(output):
    return (output,) if isinstance(output, torch.Tensor) else output if isinstance(output, (tuple, list)) else ()


def _rng_state():
    from .sandbox import rng_state

    try:
        return rng_state()
    except RuntimeError:  # a CUDA graph being captured: its generator's state cannot be read
        return None


_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"})


def is_wrapper(module):
    """Whether ``module`` is one of torch's data-parallel wrappers, whose forward keeps state across
    ranks (DDP's reducer, its buffer broadcast): a replay runs the module it wraps, never it."""
    return any(cls.__name__ in _WRAPPERS and cls.__module__.startswith("torch.") for cls in type(module).__mro__)


def autocast_state():
    """Autocast now: device type -> dtype, for the device types that have it on."""
    return {device: torch.get_autocast_dtype(device) for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)}


def versions_of(args, kwargs):
    """Each input tensor's version counter, in order (positional, then keyword; one level deep)."""
    versions = [v._version for v in args if isinstance(v, torch.Tensor) and not v.is_inference()]
    if kwargs:
        versions.extend(v._version for v in kwargs.values() if isinstance(v, torch.Tensor) and not v.is_inference())
    return tuple(versions)


def user_code(module, replay):
    """Whether ``module``'s forward is someone else's code (not torch's, not this package's)."""
    forward = getattr(type(module).forward, "__code__", None)
    filename = getattr(forward, "co_filename", "")
    return bool(filename) and replay.in_user_code(filename)


class Explained:
    """What the replay found: ``result`` (``op_replay.replay_*``'s dict, with ``module`` naming the
    module whose torch code ran an op that no line of code outside torch did), ``transient`` (True:
    not reproduced on the run's very inputs; False: reproduced; None: it cannot tell), and what the
    reproducer needs: the call replayed (None when none was), the RNG states and the inputs it
    replayed from, its incoming gradients (None for a forward), and the ``target`` submodule and
    side."""

    __slots__ = ("result", "transient", "call", "rng", "args", "kwargs", "grads", "target")

    def __init__(self, result, transient=None, call=None, rng=None, args=None, kwargs=None, grads=None,
                 target=None):
        self.result, self.transient, self.call, self.rng = result, transient, call, rng
        self.args, self.kwargs, self.grads, self.target = args, kwargs, grads, target

    def record(self):
        """The detection's ``op``: ``{"op", "file", "line", "phase", "what", "module", "reproduced"}``
        (``op`` None and ``what`` the reason where there is no op)."""
        result = self.result
        return {"op": result.get("op"), "file": result.get("file"), "line": result.get("line"),
                "phase": result.get("phase"), "what": result.get("what") or result.get("why"),
                "module": result.get("module"), "reproduced": result.get("reproduced")}

    def write_repro(self, directory, rank, step, detection, name=None):
        """The reproducer file of the call replayed (``repro.write_repro``; ``name``: its module's in
        the model); its path."""
        from .repro import write_repro

        call, target = self.call, None
        if self.target is not None:
            submodule, side = self.target
            names = {id(m): name for name, m in call.module.named_modules(remove_duplicate=False)}
            target = (names.get(id(submodule)), side)
        return write_repro(directory, rank, step, call.module, self.args, self.kwargs, self.grads, detection,
                           rng=self.rng, call=call.call_state(), target=target, name=name)


def failed(phase, error):
    """What a detection carries when looking for its op raised."""
    return Explained({"op": None, "phase": phase, "why": f"not replayed ({type(error).__name__}: {error})"})


def op_of(found, kind, kept_forward, kept_gradients, modules_by_name, class_name):
    """The op of a detection (the hook layer's ``Found``: its first frame and that call's kept
    inputs) born, as ``kind`` says (the Source line's origin), in a module's forward ("forward") or
    backward ("backward", "gradient"), or in the code between two modules ("before"): an
    ``Explained``; None for any other kind (a weight already non-finite, an input from outside, the
    loss's gradient). ``class_name(module)``: the class name a report gives a module."""
    from . import op_replay as replay  # torch's dispatch machinery: only once a detection needs it

    frame = found.first_frame
    culprit = _Culprit(replay, kept_forward, kept_gradients, modules_by_name, class_name)
    if kind == "forward":
        return culprit.forward(frame, found.kept_call)
    if kind == "before":
        return culprit.before(frame, found.kept_call)
    if kind in ("backward", "gradient"):
        return culprit.backward(frame, kind)
    return None


class _Culprit:
    def __init__(self, replay, kept_forward, kept_gradients, modules_by_name, class_name):
        self.replay = replay
        self.class_name = class_name
        self.kept_forward = kept_forward
        self.kept_gradients = kept_gradients
        self.modules_by_name = modules_by_name
        self.names = {id(module): name for name, module in modules_by_name.items()}

    # -- the cases --------------------------------------------------------------------------------

    def forward(self, frame, kept_call):
        """Born in the forward of the frame's module, from finite inputs and weights."""
        module = self.modules_by_name.get(frame.module_name)
        own = kept_call if kept_call is not None and kept_call.module is module else None
        if own is None:  # a compiled region: no call of its own was seen
            return self._inside(self._enclosing(frame.module_name, kept_call), (module, "output"), "forward")
        if not own.kept:  # let go of when it returned (no_grad): the nearest enclosing call that kept its inputs
            outer = _holding(own.parent)
            return self._inside([outer] if outer is not None else [], (module, "output"), "forward")
        replayed = self._replayed(own, lambda rng, args, kwargs: self.replay.replay_forward(
            own.module, args, kwargs, rng=rng, call=own.call_state(),
            run_output=None if own.output_changed() else own.output))
        if replayed is None:
            return Explained(_why("forward", CHANGED))
        result, *replayed = replayed
        if _transient(result, self.replay):
            return Explained(_why("forward", self.replay.TRANSIENT), True, own, *replayed)
        if not self.replay.reproduced(result) or not result.get("file"):
            # the line that calls the module, from the enclosing call that is someone else's code
            outer = self._user_ancestor(own)
            if outer is not None:
                located = self._inside([outer], (module, "output"), "forward")
                if self.replay.reproduced(located.result) and located.result.get("file"):
                    located.transient = False
                    return located
        if self.replay.reproduced(result):
            return Explained(self._named(result, module), False, own, *replayed)
        drawn_afresh = bool(result.get("random")) and not result.get("exact")  # the line says so already
        if result.get("same") is False and not drawn_afresh:
            result = _why("forward", self.replay.NOT_THE_RUN)
        return Explained(result, None, own, *replayed)

    def before(self, frame, kept_call):
        """Born in the code between modules: the enclosing call, up to the frame's module's call
        (None when it came into that call from outside it: the Source line says so)."""
        module = self.modules_by_name.get(frame.module_name)
        if kept_call is not None and kept_call.module is module:
            outer = _holding(kept_call.parent)
            calls = [outer] if outer is not None else []
        else:
            calls = self._enclosing(frame.module_name, kept_call)
        if not calls:
            return None
        explained = self._inside(calls, (module, "input"), "forward")
        if explained.result.get("why", "").startswith(self.replay.ALREADY_IN):
            return None
        return explained

    def backward(self, frame, kind):
        """Born in a backward: the module's own (its gradient came in finite), or the consumers'
        of an output whose incoming gradient is the first non-finite one."""
        name = frame.module_name
        if kind == "gradient":
            consumers = frame.consumers or []
            if len(consumers) == 1:
                name = consumers[0]
                starts = self._calls_of(name)
            else:  # the parent's own code (or several modules) used the output: the enclosing call
                starts = list({id(c.parent): c.parent for c in self._calls_of(name)
                               if c.parent is not None and not is_wrapper(c.parent.module)}.values())
        else:
            starts = self._calls_of(name)
        if not starts:
            starts = self._enclosing(name)
        if not starts:
            return Explained(_why("backward", "no inputs kept"))
        best = None
        changed = False
        for start in reversed(starts):  # the latest call whose outputs got a gradient
            for call in self._with_user_ancestor(start):
                grads = [self.kept_gradients.get(id(t)) for t in self.replay.floating_outputs(call.output)]
                if not any(g is not None for g in grads):
                    continue
                replayed = self._replayed(call, lambda rng, args, kwargs: self.replay.replay_backward(
                    call.module, args, kwargs, grads, rng=rng, call=call.call_state()))
                if replayed is None:
                    changed = True
                    continue
                result, *replayed = replayed
                explained = Explained(self._named(result, call.module), _transient(result, self.replay), call,
                                      *replayed, grads=grads)
                if self.replay.reproduced(result) and result.get("file"):
                    return explained
                best = _better(best, explained, self.replay)
        if best is None:
            return Explained(_why("backward", CHANGED if changed else "no incoming gradient kept"))
        return best

    # -- replays ----------------------------------------------------------------------------------

    def _inside(self, calls, target, phase):
        """Replay each of ``calls`` (enclosing the target's) up to ``target``'s first call whose
        inputs or outputs hold a nan/inf; the first that shows it, with a line where one does."""
        best = None
        for call in calls:
            for outer in self._with_user_ancestor(call):
                replayed = self._replayed(outer, lambda rng, args, kwargs: self.replay.replay_forward(
                    outer.module, args, kwargs, rng=rng, call=outer.call_state(), target=target))
                if replayed is None:
                    continue
                result, *replayed = replayed
                explained = Explained(self._named(result, target[0]), _transient(result, self.replay), outer,
                                      *replayed, target=target)
                if self.replay.reproduced(result) and result.get("file"):
                    return explained
                best = _better(best, explained, self.replay)
        if best is None:
            return Explained(_why(phase, CHANGED if calls else "no inputs kept"))
        return best

    def _replayed(self, call, replay_from):
        """``replay_from(rng, args, kwargs)`` for ``call``: ``(result, rng, args, kwargs)``, what it
        returned and what it replayed from; None where the call's inputs changed in place since it
        started and cannot be brought back. Inside a pass, where the call's inputs changed, or hold
        objects that may have changed unseen (a cache it appends to), or its random ops mattered,
        they are those it had at its start, brought back by running the pass again from its root
        (whose RNG states were taken) up to it; elsewhere the inputs kept, random ops drawn afresh."""
        root = call.root
        changed = call.changed()
        if call is root:
            return None if changed else (replay_from(root.rng, call.args, call.kwargs), root.rng, call.args,
                                         call.kwargs)
        arrived = None
        if changed or holds_objects(call.args, call.kwargs):
            arrived = self._arrive(call)
            if arrived is None and changed:
                return None
        if arrived is None:
            result = replay_from(None, call.args, call.kwargs)
            if not result.get("random"):
                return result, None, call.args, call.kwargs
            arrived = self._arrive(call)
            if arrived is None:
                return result, None, call.args, call.kwargs
        rng, args, kwargs = arrived
        return (replay_from(rng, args, kwargs), rng, args, kwargs)

    def _arrive(self, call):
        root = call.root
        if root.rng is None or not root.kept or root.changed():
            return None
        return self.replay.arrive_at(root.module, root.args, root.kwargs, root.rng, root.call_state(), call.module,
                                     call.ordinal)

    # -- calls ------------------------------------------------------------------------------------

    def _calls_of(self, name):
        module = self.modules_by_name.get(name)
        return [kept_call for kept_call in self.kept_forward if kept_call.module is module and module is not None]

    def _enclosing(self, name, around=None):
        """The calls enclosing the module named ``name`` (its hooks were traced, so it kept none):
        the nearest among ``around`` and its parents (the eager call that absorbed the compiled
        region), or else the kept calls of the nearest enclosing module that has some."""
        call = around
        while call is not None:
            outer = self.names.get(id(call.module))
            if (outer is not None and outer != name and (outer == "" or name.startswith(outer + "."))
                    and not is_wrapper(call.module)):
                held = _holding(call)
                return [held] if held is not None else []
            call = call.parent
        while name:
            name = name.rpartition(".")[0]
            calls = [call for call in self._calls_of(name) if not is_wrapper(call.module)]
            if calls:
                return calls
        return []

    def _with_user_ancestor(self, call):
        """``call``, then, where its forward is torch's own, the nearest enclosing call whose
        forward is someone else's code (its replay shows the line that calls the module)."""
        if user_code(call.module, self.replay):
            return [call]
        outer = self._user_ancestor(call)
        return [call] if outer is None else [call, outer]

    def _user_ancestor(self, call):
        """The nearest call enclosing ``call`` whose forward is someone else's code (or, where that
        one let go of its inputs, the nearest enclosing it that kept them), or None."""
        outer = call.parent
        while outer is not None and not user_code(outer.module, self.replay):
            outer = outer.parent
        return _holding(outer)

    def _named(self, result, module):
        """A result whose op no line outside torch ran names the module whose torch code did."""
        if result.get("op") is not None and not result.get("file"):
            name = self.names.get(id(module))
            if name is not None:
                result = {**result, "module": f"{name or '(model)'} ({self.class_name(module)})"}
        return result


def _holding(call):
    """``call``, or where it let go of its inputs (``KeptCall.release``) the nearest call enclosing
    it that kept them; None when none did."""
    while call is not None and not call.kept:
        call = call.parent
    return call


def _why(phase, why):
    return {"op": None, "phase": phase, "why": why}


def _transient(result, replay):
    """False where the replay made the nan/inf again; True where it ran on the run's very inputs,
    every random op from the run's RNG states, and gave the run's values wherever those were
    finite and finite ones where they were not; None where it cannot tell."""
    if replay.reproduced(result):
        return False
    return True if result.get("why") == replay.NOT_REPRODUCED and result.get("same") is True else None


def _better(best, explained, replay):
    """The result to keep of two that named no line: one that reproduced over one that did not."""
    if best is None or (replay.reproduced(explained.result) and not replay.reproduced(best.result)):
        return explained
    return best
