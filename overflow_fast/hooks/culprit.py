"""Which call a detection's replay runs (``find_op``), and what it finds.

With ``find_op`` each hooked call keeps references (never copies) to its inputs, until its pass
ends, or, for a forward with autograd on, until the backward pass that follows it ends (the
backward's replay runs that forward again). A detection born in a module's forward or backward is
then replayed: that one call alone, every op's outputs checked (``find_op``), and the first op that
made a nan/inf from finite inputs is named with the line of code that ran it.

The line: the innermost frame of the user's code (outside torch and this package). A module
whose ``forward`` is torch's own (``nn.Linear``) has no such frame in its own replay, so the call
replayed is that of its nearest enclosing module whose ``forward`` is someone else's code: the
op's frame is then the line that calls the module. Without such an ancestor the line is where the
model was called (the stack at the detection, or at the outermost call).

Under no_grad (and inference mode) autograd keeps nothing, and neither does a call once it
returned (``release``): only the calls still running keep their inputs, so a pass holds no more
than it would without find_op. A released call is replayed through its nearest enclosing call
that kept its inputs (the outermost one, at the end of a pass).
"""

import torch


_AUTOCAST_DEVICES = ("cpu", "cuda")


class CallInputs:
    """One hooked call as its replay needs it: the module, its positional and keyword inputs
    (references), their versions when it started, the call it ran in, its grad mode, the autocast
    of its forward (``autocast_state``, taken once per forward) and its output."""

    __slots__ = ("module", "args", "kwargs", "versions", "parent", "grad_enabled", "autocast", "output", "kept")

    def __init__(self, module, args, kwargs, parent, autocast):
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.versions = versions_of(args, kwargs)
        self.parent = parent
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = autocast
        self.output = None
        self.kept = True  # False once released

    def release(self):
        """Let go of the inputs: a replay runs the nearest enclosing call that kept them."""
        self.args = self.kwargs = self.output = None
        self.kept = False

    def changed(self):
        """Whether an input changed in place since the call started."""
        return versions_of(self.args, self.kwargs) != self.versions

    def call_state(self):
        """What the replay runs under (``find_op.call_state``'s form)."""
        return {"grad_enabled": self.grad_enabled, "autocast": self.autocast}


def autocast_state():
    """Autocast now: device type -> dtype, for the device types that have it on."""
    return {device: torch.get_autocast_dtype(device) for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)}


def versions_of(args, kwargs):
    """Each input tensor's version counter, in order (positional, then keyword; one level deep)."""
    values = list(args) + (list(kwargs.values()) if kwargs else [])
    return tuple(v._version for v in values if isinstance(v, torch.Tensor) and not v.is_inference())


def user_code(module, replay):
    """Whether ``module``'s forward is someone else's code (not torch's, not this package's)."""
    forward = getattr(type(module).forward, "__code__", None)
    filename = getattr(forward, "co_filename", "")
    return bool(filename) and replay.in_user_code(filename)


def find_op(found, kept_forward, kept_gradients, modules_by_name):
    """The op of a detection (``decisions.Found``) born in a module's forward or backward, as
    ``find_op.replay_*`` gives it (``{"op", "file", "line", "phase", "what"}`` or ``{"op": None,
    "phase", "why"}``), with the call replayed (``CallInputs``) and its incoming gradients (None
    for a forward); or None when the detection was not born in a module (a weight already
    non-finite, an input from outside, the loss's gradient)."""
    from . import find_op as replay
    from .policy import origin

    kind = origin(found.first_frame, found.bad)
    if kind == "forward":
        return _forward(found.inputs, replay)
    if kind == "before":  # made in the enclosing call's own code, before this module ran
        parent = found.inputs.parent if found.inputs is not None else None
        if parent is None:
            return None, None, None
        result, call, grads = _forward(parent, replay)
        if result.get("op") is None and result["why"].startswith(replay.ALREADY_IN):
            return None, None, None  # it came into the parent from outside: the Source line says so
        return result, call, grads
    if kind == "backward":
        return _backward(_calls_of(kept_forward, found.first_frame.module_name, modules_by_name), kept_gradients,
                         replay)
    if kind == "gradient":
        consumers = found.first_frame.consumers or []
        if len(consumers) != 1:
            return {"op": None, "phase": "backward", "why": f"not replayed ({len(consumers)} modules consume "
                    "that gradient)"}, None, None
        return _backward(_calls_of(kept_forward, consumers[0], modules_by_name), kept_gradients, replay)
    return None, None, None


def _calls_of(kept_forward, name, modules_by_name):
    module = modules_by_name.get(name)
    return [inputs for inputs in kept_forward if inputs.module is module and module is not None]


def _user_ancestors(inputs, replay):
    """The calls whose replay may show the line: the nearest enclosing call whose forward is user
    code (its replay runs the op from the line that called the module), then the call itself."""
    chain = []
    outer = inputs
    while outer is not None and not user_code(outer.module, replay):
        outer = outer.parent
    if outer is not None and outer is not inputs:
        chain.append(outer)
    chain.append(inputs)
    return chain


def _forward(inputs, replay):
    """Replay the forward of ``inputs``' call (or first of its nearest user-code ancestor): the
    result, the call replayed (for the reproducer; the call itself when no replay showed it) and
    None (no incoming gradients)."""
    if inputs is None:
        return {"op": None, "phase": "forward", "why": "no inputs kept"}, None, None
    calls = _kept(_user_ancestors(inputs, replay))
    if not calls:
        return {"op": None, "phase": "forward", "why": "no inputs kept"}, None, None
    result = None
    for call in calls:
        if call.changed():
            continue
        result = replay.replay_forward(call.module, call.args, call.kwargs, call=call.call_state())
        if result.get("op") is not None:
            return _located(result, replay), call, None
    if result is None:
        return {"op": None, "phase": "forward",
                "why": "not reproduced on replay (the module's inputs changed in place after its hook)"}, None, None
    return result, inputs if inputs.kept else call, None


def _kept(chain):
    """The calls of ``chain``, each released one (``CallInputs.release``) replaced by its nearest
    enclosing call that kept its inputs, once each."""
    found = []
    for call in chain:
        while call is not None and not call.kept:
            call = call.parent
        if call is not None and call not in found:
            found.append(call)
    return found


def _backward(calls, kept_gradients, replay):
    """Replay the backward of the latest call among ``calls`` (the module's forward calls whose
    outputs received a gradient) that shows where the nan/inf came from; returned as ``_forward``
    does, with the call's incoming gradients."""
    if not calls:
        return {"op": None, "phase": "backward", "why": "no inputs kept"}, None, None
    result = tried = None
    changed = False
    for inputs in reversed(calls):
        for call in _user_ancestors(inputs, replay):
            grads = [kept_gradients.get(id(t)) for t in replay.floating_outputs(call.output)]
            if not any(g is not None for g in grads):
                continue
            if call.changed():
                changed = True
                continue
            result = replay.replay_backward(call.module, call.args, call.kwargs, grads, call=call.call_state())
            if result.get("op") is not None:
                return _located(result, replay), call, grads
            if tried is None or call is inputs:
                tried = call, grads
    if result is None:
        why = ("not reproduced on replay (the module's inputs changed in place after its hook)" if changed
               else "no incoming gradient kept")
        return {"op": None, "phase": "backward", "why": why}, None, None
    return result, tried[0], tried[1]


def _located(result, replay):
    """A result without a line (torch's own code alone ran it): the innermost user frame of the
    stack now, where the model was called."""
    if result.get("file") is None:
        filename, line = replay.location(replay.live_frames())
        if filename is not None:
            result = {**result, "file": filename, "line": line}
    return result
