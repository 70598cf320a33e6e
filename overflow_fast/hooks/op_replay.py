"""The op and the line of code that made the first nan/inf of one module call, found by replaying
that call alone with every op checked; and the reproducer file that replays it in another process.

``replay_forward(module, args, kwargs)`` runs ``module(*args, **kwargs)`` once under a
``TorchDispatchMode`` that reads every op's inputs before the op and its outputs after it.
``replay_backward(module, args, kwargs, grad_outputs)`` replays the forward the same way with
autograd on, then its backward with the call's incoming gradients. An op whose output holds a
nan/inf while everything it read was finite *made* that nan/inf; an op that read one passes on where
it came from (kept per storage, so writes through views count). The answer is where the nan/inf in
the replayed call's result came from, so an inf made and then dropped on the way (the ``exp`` of a
hand-written softplus in the branch that ``where`` does not take) is not blamed. With ``target``
the answer is about one submodule's call inside the replayed one instead (the first whose inputs or
outputs hold a nan/inf), and the replay stops there.

Each returns a dict: ``{"op", "file", "line", "phase", "what", "reproduced"}``, e.g. ``{"op":
"aten.exp", "file": "/home/me/model.py", "line": 42, "phase": "forward", "what": "inf from finite
inputs (input abs max 8.9e+01)", "reproduced": "on the same inputs"}``. In backward ``op`` is the
autograd node that ran the op (``SqrtBackward0``) and the line is that of its forward op.
``file:line`` is the innermost frame of the replayed call that lies outside torch's package and this
one, or None when there is none (an ``nn.Linear`` replayed alone runs only torch's code: the caller
knows which module that was, ``"module"``). ``reproduced`` says how: on the same inputs, or with
fresh random draws (a random op ran before it and no RNG state was given). Where the replay cannot
show it: ``{"op": None, "phase", "why"}``, the reason in words; it never guesses. Every result also
carries ``random`` (the random ops that ran before the nan/inf, or in the whole replay when it did
not reproduce one), ``exact`` (whether they drew from a given RNG state) and, with ``run_output``,
``same`` (whether the replay's result equals the run's wherever the run's is finite).
``op_line(result)`` is the report's line.

The replay leaves the run as it was: the module's buffers are replaced by copies for the replay
(BatchNorm's running statistics in train mode), its attributes and its parameters' and inputs'
contents are untouched (inputs are copied, and so are the objects they hold: a cache the call
appends to), no ``.grad`` is written (``torch.autograd.grad``), the CPU and CUDA RNG states are
restored, no autograd graph outlives it, no forward or backward hook of the module, its
submodules or the global ones runs (but tensor parallelism's, which hold no state), and nothing is
sent to other ranks: a collective stops the replay before it runs (``_never_communicates``). The
memory it takes while it runs: a copy of the call's inputs and of the module's buffers, the
replayed call's activations, and for backward its gradients; nothing is kept after.
"""

import ast
import contextlib
import copy
import functools
import math
import os
import pickle
import re
import sys
import types
import warnings
from collections import OrderedDict

import torch
import torch.nn.modules.module as _torch_module
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed import NoCommunication, active_guard, communicating, holds_sharded_parameters, local_shard

REPRO_FORMAT = "overflow_fast reproducer"
REPRO_VERSION = 1

NOT_REPRODUCED = "not reproduced on replay (no op made a nan/inf from finite inputs)"
ALREADY_IN = "not reproduced on replay (the nan/inf was already in"
# the replay ran on the run's very inputs and gave the run's values, but finite ones where the run's
# were not
TRANSIENT = ("not reproduced on the same inputs: a transient fault (hardware, a race, memory corruption) "
             "is likely")
# the replay gave finite values, but not the run's elsewhere either: it did not run what the run ran
NOT_THE_RUN = ("not reproduced on replay, whose finite values differ from the run's too (an input changed "
               "unseen, e.g. a write that bypasses the version counter): a transient fault cannot be told")
SAME_INPUTS = "on the same inputs"

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# this package's machinery, never the user's code (its demos are: they stand for a user's model)
_MACHINERY_DIRS = tuple(os.path.join(_PACKAGE, folder) + os.sep for folder in
                        ("hooks", "stats", "recording", "report", "distributed", "integrations"))
_THIS_FILE = os.path.realpath(__file__)

_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")
_AUTOCAST_DEVICES = ("cpu", "cuda")

# ops whose output is memory nobody wrote yet: a nan/inf in it was made by no op
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                            "new_empty_strided", "resize_", "resize_as_", "set_", "_resize_output_"})
# in-place ops that write ``self`` without reading it
_WRITE_ONLY_SELF = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_",
                              "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
                              "set_", "resize_", "resize_as_"})
# ops that turn a tensor made outside any op (``torch.tensor(...)``'s data) into a constant
_CONSTANTS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})
# read through float32: torch's reductions do not take these
_UPCAST = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))


# -- the result -------------------------------------------------------------------------------------

def op_line(result):
    """``Op: aten.exp at /home/me/model.py:42: inf from finite inputs (input abs max 8.9e+01);
    reproduced on the same inputs``; where no line of code outside torch ran it, the module whose
    torch code did (``"module"``: ``Op: aten.addmm in 0 (Linear), torch's own code: inf ...``);
    where there is no op, ``Op: <why>`` (with how it was reproduced, if it was)."""
    how = f"; reproduced {result['reproduced']}" if result.get("reproduced") else ""
    if result.get("op") is None:
        return f"Op: {result['why']}{how}"
    if result.get("file"):
        where = f" at {result['file']}:{result['line']}"
    elif result.get("module"):
        where = f" in {result['module']}, torch's own code"
    else:
        where = ""
    return f"Op: {result['op']}{where}: {result['what']}{how}"


def _why(phase, why):
    return {"op": None, "phase": phase, "why": why}


def reproduced(result):
    """Whether the replay made the nan/inf again (an op, a non-finite constant, uninitialized memory)."""
    return bool(result.get("reproduced"))


# -- what the replay keeps as it was -----------------------------------------------------------------

@contextlib.contextmanager
def without_hooks(module, keep_tensor_parallel=False):
    """No forward, forward-pre or backward hook runs inside: those of ``module`` and its submodules,
    and the global ones (``register_module_forward_hook``...), are set aside and put back after.
    ``keep_tensor_parallel``: but those of tensor parallelism stay (``_tensor_parallel_hooks``)."""
    modules = _unique_modules(module)
    saved = [(m, {name: m.__dict__[name] for name in _MODULE_HOOKS if name in m.__dict__})
             for m in modules]
    global_saved = {}
    try:
        for m, hooks in saved:
            for name in hooks:
                m.__dict__[name] = _tensor_parallel_hooks(name, hooks[name]) if keep_tensor_parallel else OrderedDict()
        for name in _GLOBAL_HOOKS:
            hooks = getattr(_torch_module, name, None)
            if isinstance(hooks, dict):
                global_saved[name] = dict(hooks)
                hooks.clear()
        yield module
    finally:
        for m, hooks in saved:
            m.__dict__.update(hooks)
        for name, hooks in global_saved.items():
            live = getattr(_torch_module, name)
            live.clear()
            live.update(hooks)


def _tensor_parallel_hooks(name, hooks):
    """The forward hooks of torch.distributed.tensor (``distribute_module``, which
    ``parallelize_module`` uses): they turn a call's local inputs into DTensors and its outputs back,
    holding no state, so that a replay runs as the call did (a collective they would run is refused
    like any other)."""
    if name not in ("_forward_pre_hooks", "_forward_hooks"):
        return OrderedDict()
    return OrderedDict((key, hook) for key, hook in hooks.items()
                       if getattr(hook, "__module__", "").startswith("torch.distributed.tensor"))


def replay_hooks(module):
    """What a replay runs without: every hook of ``without_hooks`` but tensor parallelism's."""
    return without_hooks(module, keep_tensor_parallel=True)


def _gathered_for_the_call(module):
    """The name (within ``module``; "" for itself) of a module whose parameters are sharded across
    ranks with no tensor-parallel hook of its own to run its forward on them (FSDP2's, which
    gathers them for each call only), or None."""
    for name, sub in module.named_modules():
        if holds_sharded_parameters(sub) and not _tensor_parallel_hooks("_forward_pre_hooks", sub._forward_pre_hooks):
            return name
    return None


def _unique_modules(module):
    return list(module.modules())  # modules() yields a shared submodule once


def _restore(live, saved):
    for key in [key for key in live if key not in saved]:
        del live[key]
    live.update(saved)


@contextlib.contextmanager
def _module_kept(module, fresh_parameters):
    """Each submodule's attributes, parameters, buffers and children are as before after the block;
    inside, its buffers are copies (what the forward writes into them is dropped), it runs eagerly
    (a ``module.compile()``'d one too: the dispatch mode must see every op), and with
    ``fresh_parameters`` its parameters are new leaves sharing their data, with no hooks (tensor
    hooks fire in ``torch.autograd.grad`` too)."""
    modules = _unique_modules(module)
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
             for m in modules]
    replaced = {}
    try:
        with torch.no_grad():
            for m in modules:
                for name, buffer in m._buffers.items():
                    if buffer is not None:
                        if id(buffer) not in replaced:
                            replaced[id(buffer)] = buffer.clone()
                        m._buffers[name] = replaced[id(buffer)]
                if fresh_parameters:
                    for name, parameter in m._parameters.items():
                        if type(parameter) is torch.nn.Parameter:  # a subclass is kept as it is
                            if id(parameter) not in replaced:
                                replaced[id(parameter)] = torch.nn.Parameter(
                                    parameter.detach(), requires_grad=parameter.requires_grad)
                            m._parameters[name] = replaced[id(parameter)]
                m.__dict__["_compiled_call_impl"] = None
        yield
    finally:
        for m, attributes, parameters, buffers, children in saved:
            _restore(m.__dict__, attributes)
            _restore(m._parameters, parameters)
            _restore(m._buffers, buffers)
            _restore(m._modules, children)


def rng_state():
    """The CPU and CUDA RNG states now (CUDA's only where CUDA is initialized): take it just before
    a call to replay that call's random ops exactly (``rng=``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(state):
    if state.get("cpu") is not None:
        torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _rng_kept(rng):
    before = rng_state()
    try:
        if rng is not None:
            _set_rng_state(rng)
        yield
    finally:
        _set_rng_state(before)


def call_state():
    """What a call ran under, beyond its inputs: grad mode and autocast (device type -> dtype).
    Take it at the call when the replay runs later (``call=``)."""
    autocast = {device: torch.get_autocast_dtype(device) for device in _AUTOCAST_DEVICES
                if torch.is_autocast_enabled(device)}
    return {"grad_enabled": torch.is_grad_enabled(), "autocast": autocast}


def _autocast_as(stack, autocast):
    """Autocast as ``autocast`` says, for the device types that have it; off elsewhere."""
    for device in _AUTOCAST_DEVICES:
        dtype = autocast.get(device)
        if dtype is not None:
            if device == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device, dtype=dtype))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))


def floating_outputs(output):
    """The floating tensors of a module's output, depth first: a tensor, the items of a tuple or a
    list, the values of a dict (a transformers ``ModelOutput``) in order. ``replay_backward``'s
    ``grad_outputs`` follow this order."""
    found = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(output)
    return found


_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.nn.Module)


def _copied(value, requires_grad=True):
    """A copy of ``value`` (args, kwargs, gradients) for a replay or a file: tensors detached and
    cloned (``requires_grad`` as they had, with ``requires_grad``), shared ones still shared, in the
    objects that hold them too (a transformers cache holding a graph's tensors); other objects
    deep-copied (a cache the call appends to), modules and plain values as they are."""
    memo = {}

    def tensor_copy(tensor):
        clone = memo.get(id(tensor))
        if clone is None:
            with torch.no_grad():
                clone = tensor.detach().clone()
            if requires_grad and tensor.requires_grad:
                clone.requires_grad_(True)
            memo[id(tensor)] = clone
        return clone

    leaves, spec = pytree.tree_flatten(value)
    copies = []
    with _TensorsCloned(tensor_copy):
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                copies.append(tensor_copy(leaf))
            elif isinstance(leaf, _ATOMS) or callable(leaf):
                copies.append(leaf)
            else:
                copies.append(copy.deepcopy(leaf, memo))
    return pytree.tree_unflatten(copies, spec)


class _TensorsCloned(TorchFunctionMode):
    """Inside, ``copy.deepcopy`` copies a tensor as ``tensor_copy`` does: deepcopy refuses a tensor
    that is not a leaf of autograd's graph (the keys and values of a cache, under grad mode)."""

    def __init__(self, tensor_copy):
        super().__init__()
        self.tensor_copy = tensor_copy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__:
            return self.tensor_copy(args[0])
        return func(*args, **(kwargs or {}))


# -- reading tensors --------------------------------------------------------------------------------

def _abs_max(tensor):
    """max |x| as a float: nan when it holds a nan, inf when an inf; None when it has no values
    to read (empty, bool, a kind these reductions do not take). A DTensor: this rank's shard."""
    tensor = local_shard(tensor)
    if tensor.dtype == torch.bool or tensor.numel() == 0:
        return None
    try:
        if tensor.is_complex():
            return tensor.abs().max().item()
        if tensor.dtype in _UPCAST:
            tensor = tensor.float()
        low, high = torch.aminmax(tensor)
        low, high = low.item(), high.item()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if isinstance(low, float) and (math.isnan(low) or math.isnan(high)):
        return math.nan
    return float(max(abs(low), abs(high)))


def _is_finite(value):
    return value is None or math.isfinite(value)


def _nonfinite_kinds(tensors):
    nan = inf = False
    for tensor in tensors:
        tensor = local_shard(tensor)
        if tensor.dtype in _UPCAST:
            tensor = tensor.float()
        nan = nan or bool(torch.isnan(tensor).any())
        inf = inf or bool(torch.isinf(tensor).any())
    return "nan and inf" if nan and inf else "nan" if nan else "inf"


def _storage_key(tensor):
    tensor = local_shard(tensor)
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _covers_storage(tensor):
    tensor = local_shard(tensor)
    try:
        return (tensor.storage_offset() == 0
                and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def _floats_in(value):
    if isinstance(value, float):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, float)]
    return []


def _arguments(func, short, args, kwargs):
    """(read tensors, written tensors, read Python floats) of one op call, by its schema: an
    ``out=`` tensor and the ``self`` of ``copy_``/``fill_``... are written, not read (their old
    contents, maybe uninitialized memory, do not feed the result)."""
    try:
        schema = func._schema.arguments
    except AttributeError:
        leaves = pytree.tree_leaves((args, kwargs))
        return [t for t in leaves if isinstance(t, torch.Tensor)], [], []
    by_name = {argument.name: argument for argument in schema}
    pairs = list(zip(schema, args)) + [(by_name.get(key), value) for key, value in kwargs.items()]
    read, written, floats = [], [], []
    for position, (argument, value) in enumerate(pairs):
        writes = argument is not None and argument.alias_info is not None and argument.alias_info.is_write
        if writes:
            written.extend(_tensors_in(value))
        out = argument is not None and argument.is_out
        write_only = writes and position == 0 and short in _WRITE_ONLY_SELF
        if not (out or write_only):
            read.extend(_tensors_in(value))
            floats.extend(_floats_in(value))
    return read, written, floats


def _draws_random(func, short, args, kwargs):
    """Whether the op draws random numbers: tagged so, and not switched off (attention and RNNs are
    tagged for their dropout, which ``dropout_p=0``, ``train=False`` or ``p=0`` turns off)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    values = {}
    for argument in func._schema.arguments:
        if argument.has_default_value():
            values[argument.name] = argument.default_value
    values.update((argument.name, value) for argument, value in zip(func._schema.arguments, args))
    values.update(kwargs)
    if values.get("train", True) is False or values.get("dropout_p", 1) == 0:
        return False
    if "dropout" in short and values.get("p", 1) == 0:
        return False
    if short in ("lstm", "gru", "rnn_tanh", "rnn_relu") and values.get("dropout", 1) == 0:
        return False
    return True


# -- where a frame is -------------------------------------------------------------------------------

_user_files = {}


def in_user_code(filename):
    """Whether ``filename`` is the user's code: outside torch and this package's machinery."""
    known = _user_files.get(filename)
    if known is None:
        path = os.path.realpath(filename)
        known = not (filename.startswith("<") or path.startswith(_TORCH_DIR)
                     or path.startswith(_MACHINERY_DIRS))
        _user_files[filename] = known
    return known


def _call_module(module, args, kwargs):
    # the replayed call's own frames are the ones inside this one
    return module(*args, **kwargs)


def location(frames):
    """The innermost of ``frames`` (filename, line, function; innermost first) inside the replayed
    call and outside torch and this package: (file, line), or (None, None)."""
    for filename, line, function in frames:
        if function == _call_module.__name__ and os.path.realpath(filename) == _THIS_FILE:
            break
        if in_user_code(filename):
            return filename, line
    return None, None


def live_frames():
    """(filename, line, function) of the caller's stack, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


_TRACEBACK_ENTRY = re.compile(r'\s*File "(.*)", line (\d+), in (\S+)')


def _node_frames(node):
    """The frames of the forward op that made an autograd node (anomaly mode keeps its stack)."""
    try:
        stack = node.metadata.get("traceback_") or []
    except (RuntimeError, AttributeError):
        stack = []
    frames = []
    for entry in reversed(stack):
        match = _TRACEBACK_ENTRY.match(entry)
        if match:
            frames.append((match.group(1), int(match.group(2)), match.group(3)))
    return frames


# -- the dispatch mode ------------------------------------------------------------------------------

_OUTSIDE = {"kind": "outside", "seq": 0}


class _Births(TorchDispatchMode):
    """Reads every op's inputs and outputs; notes, for each storage holding a nan/inf, where it
    came from (``origins``), and which random ops ran (``random_ops``, with their order). With
    ``reading`` False (or while ``paused``) ops run as they are, unread: a replay that only needs
    to get somewhere still runs under the mode, and its refusals."""

    def __init__(self, reading=True):
        super().__init__()
        self.reading = reading
        self.phase = "forward"
        self.seq = 0
        self.origins = {}
        self.random_ops = []
        self.guard = active_guard() or NoCommunication()  # the replay's
        if self.guard.on_refuse is None:
            self.guard.on_refuse = self._refused

    @contextlib.contextmanager
    def paused(self):
        """Ops run unread inside (this package's own reads, in a hook of the replay)."""
        reading, self.reading = self.reading, False
        try:
            yield
        finally:
            self.reading = reading

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a replay never communicates: a collective is stopped before it runs, here, and by the
        # guard in the ops a tensor subclass's dispatch runs (on autograd's threads too)
        collective = communicating(func)
        if collective is not None:
            self.guard.refuse(collective, pytree.tree_leaves((args, kwargs)))
        with self.guard:
            return self._dispatch(func, types, args, kwargs)

    def _dispatch(self, func, types, args, kwargs):
        kwargs = kwargs or {}
        if not self.reading:
            return func(*args, **kwargs)
        self.seq += 1
        name = str(getattr(func, "overloadpacket", func))
        short = name.rsplit(".", 1)[-1]
        if _draws_random(func, short, args, kwargs):
            self.random_ops.append((self.seq, name))
        read, written, floats = _arguments(func, short, args, kwargs)
        read_floating = [t for t in read if t.is_floating_point() or t.is_complex()]
        read_max = [_abs_max(t) for t in read_floating]  # before the op: it may write its inputs
        bad_inputs = [t for t, m in zip(read_floating, read_max) if not _is_finite(m)]
        bad_constant = any(not math.isfinite(f) for f in floats)

        result = func(*args, **kwargs)

        outputs, seen = [], set()
        for tensor in _tensors_out(result) + written:
            if id(tensor) not in seen and (tensor.is_floating_point() or tensor.is_complex()):
                seen.add(id(tensor))
                outputs.append(tensor)
        bad_outputs = []
        for tensor in outputs:
            if _is_finite(_abs_max(tensor)):
                if _covers_storage(tensor):
                    self.origins.pop(_storage_key(tensor), None)
            else:
                bad_outputs.append(tensor)
        if not bad_outputs:
            return result

        if short in _UNINITIALIZED:
            origin = self._made("uninitialized", name)
        elif bad_inputs:
            if short in _CONSTANTS:
                origin = self._made("constant", name)
            else:
                origin = min((self.origins.get(_storage_key(t), _OUTSIDE) for t in bad_inputs),
                             key=lambda o: o["seq"])
        elif bad_constant:
            origin = self._made("constant", name)
        else:
            magnitudes = [m for m in read_max if m is not None] + [abs(f) for f in floats]
            if not magnitudes:  # an integer tensor cast to a dtype it does not fit
                magnitudes = [m for m in (_abs_max(t) for t in read) if m is not None]
            what = f"{_nonfinite_kinds(bad_outputs)} from finite inputs"
            if magnitudes:
                what += f" (input abs max {max(magnitudes):.1e})"
            origin = self._made("op", name, what)
        for tensor in bad_outputs:
            key = _storage_key(tensor)
            if key is not None:
                self.origins[key] = origin
        return result

    def _refused(self, op, inputs):
        """A collective refused: where a nan/inf it would read came from, as words for the Op line."""
        bad = [t for t in inputs if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               and not _is_finite(_abs_max(t))]
        if not bad:
            return None
        origin = min((self.origins.get(_storage_key(t), _OUTSIDE) for t in bad), key=lambda o: o["seq"])
        if origin["kind"] == "outside":
            return "what it reads held a nan/inf when the call began"
        where = f" at {origin['file']}:{origin['line']}" if origin["file"] else ""
        if origin["kind"] == "op":
            return f"before it, {origin['op']}{where} made {origin['what']}, which it reads"
        return f"before it, a {origin['kind']} {origin['op']}{where} gave a nan/inf, which it reads"

    def _made(self, kind, name, what=None):
        origin = {"kind": kind, "seq": self.seq, "op": name, "phase": self.phase, "what": what}
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                origin["op"] = node.name()
                origin["file"], origin["line"] = location(_node_frames(node))
            else:  # the engine's own op (summing the gradients of a tensor used twice)
                origin["file"] = origin["line"] = None
        else:
            origin["file"], origin["line"] = location(live_frames())
        return origin

    def verdict(self, results, phase, exact_random):
        """Where the first nan/inf among ``results`` (the replayed call's outputs, or gradients)
        came from, as the module's docstring says."""
        randoms = list(dict.fromkeys(name for _, name in self.random_ops))
        bad = [t for t in results if not _is_finite(_abs_max(t))]
        if not bad:
            why = NOT_REPRODUCED
            if randoms and not exact_random:
                why = f"not reproduced on replay (random ops: {', '.join(randoms)}, drawn afresh)"
            return {**_why(phase, why), "random": randoms, "exact": exact_random}
        origin = min((self.origins.get(_storage_key(t), _OUTSIDE) for t in bad), key=lambda o: o["seq"])
        if origin["kind"] == "outside":
            made_from = ("its inputs, parameters, buffers or incoming gradients" if phase == "backward"
                         else "its inputs, parameters or buffers")
            return {**_why(phase, f"{ALREADY_IN} {made_from})"), "random": [], "exact": exact_random}
        earlier = list(dict.fromkeys(name for seq, name in self.random_ops if seq < origin["seq"]))
        how = (SAME_INPUTS if exact_random or not earlier
               else f"with fresh random draws ({', '.join(earlier)})")
        where = f" at {origin['file']}:{origin['line']}" if origin["file"] else ""
        if origin["kind"] == "constant":
            result = _why(origin["phase"], f"the nan/inf comes from a non-finite constant ({origin['op']}{where})")
        elif origin["kind"] == "uninitialized":
            result = _why(origin["phase"], f"the nan/inf comes from uninitialized memory ({origin['op']}{where})")
        else:
            result = {"op": origin["op"], "file": origin["file"], "line": origin["line"],
                      "phase": origin["phase"], "what": origin["what"]}
        return {**result, "reproduced": how, "random": earlier, "exact": exact_random}


def _tensors_out(result):
    return [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]


# -- the replays -------------------------------------------------------------------------------------

def _failed(phase, error):
    message = str(error).strip().splitlines()
    return _why(phase, f"not replayed ({type(error).__name__}: {message[0] if message else ''})")


class _Reached(BaseException):
    """Ends a replay where it got what it came for (user code's ``except Exception`` lets it by)."""


def _stop_at(target, births, stopped):
    """A hook on ``target = (submodule, "input" | "output")``, for the replay's duration: at the
    submodule's first call whose inputs (outputs) hold a nan/inf, keep its floating tensors in
    ``stopped`` and end the replay. Returns the hook's handle."""
    submodule, side = target

    def check(values):
        tensors = floating_outputs(values)
        with births.paused():
            if any(not _is_finite(_abs_max(t)) for t in tensors):
                stopped.extend(tensors)
                raise _Reached

    if side == "input":
        return submodule.register_forward_pre_hook(lambda m, args, kwargs: check((args, kwargs)), with_kwargs=True)
    return submodule.register_forward_hook(lambda m, args, output: check(output))


def _agrees(run, replayed):
    """Whether ``replayed`` (tensors) equals ``run`` wherever ``run`` is finite; None when they cannot
    be compared (another structure, shape or dtype, or no finite value in the run's)."""
    if len(run) != len(replayed):
        return None
    compared = 0
    try:
        for ran, again in zip(run, replayed):
            if ran.shape != again.shape or ran.dtype != again.dtype:
                return None
            if ran.dtype in _UPCAST:
                ran, again = ran.float(), again.float()
            finite = torch.isfinite(ran)
            if not torch.equal(ran[finite], again.to(ran.device)[finite]):
                return False
            compared += int(finite.sum())
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return True if compared else None


def _replaying(stack, module, rng, call, without_hooks=replay_hooks, backward=False):
    """Enter what every replay runs inside: no hook of the module runs (``without_hooks``), its
    buffers (and for a ``backward`` its parameters) are stand-ins, the RNG as ``rng`` says and
    restored after, grad mode (a backward's: on) and autocast as ``call`` says."""
    stack.enter_context(without_hooks(module))
    stack.enter_context(_module_kept(module, fresh_parameters=backward))
    stack.enter_context(_rng_kept(rng))
    if call is not None:
        _autocast_as(stack, call.get("autocast") or {})
        if not backward:
            stack.enter_context(torch.set_grad_enabled(call["grad_enabled"]))
    if backward:
        stack.enter_context(torch.enable_grad())


def _never_communicates(phase):
    """A replay on one rank must never run a collective (it would pair with the other ranks' next
    one, or wait for ever): it runs inside a guard that stops the first before it sends anything,
    and then says so, whatever the replay made of the error; with what it had seen before, where
    that collective would read a nan/inf. A module whose parameters FSDP2 sharded again after the
    call is not replayed: gathering them would communicate."""
    def decorate(replay):
        @functools.wraps(replay)
        def guarded(module, *args, **kwargs):
            gathered = _gathered_for_the_call(module)
            if gathered is not None:
                return _why(phase, f"not replayed (the parameters of {gathered or 'the module'} are sharded across "
                                   "ranks, and gathering them would communicate: FSDP2 gathers them for each call "
                                   "only, unless reshard_after_forward=False)")
            with NoCommunication() as guard, warnings.catch_warnings():
                # anomaly mode's "Error detected in ...Backward" for an error the Op line reports
                warnings.filterwarnings("ignore", "Error detected in", UserWarning)
                result = replay(module, *args, **kwargs)
            if guard.refused is None:
                return result
            filename, line = location(guard.frames)
            where = f" at {filename}:{line}" if filename else ""
            note = f"; {guard.note}" if guard.note else ""
            return _why(result["phase"], f"not replayed (the call communicates across ranks: {guard.refused}{where})"
                                         f"{note}")
        return guarded
    return decorate


@_never_communicates("forward")
def replay_forward(module, args=(), kwargs=None, *, rng=None, call=None, target=None, run_output=None,
                   without_hooks=replay_hooks):
    """Replay ``module(*args, **kwargs)`` alone with every op checked; the result as the module's
    docstring says (phase "forward").

    ``rng``: the RNG states taken just before the call (``rng_state()``); with it random ops
    (dropout) replay exactly, without it they draw afresh and the result says so. ``call``:
    ``call_state()`` taken at the call (grad mode, autocast); None runs under the current ones.
    ``target``: ``(submodule, "input" | "output")``: the answer is about that submodule's first call
    inside this one whose inputs (outputs) hold a nan/inf, and the replay ends there. ``run_output``:
    the call's output in the run, to tell whether the replay computed the same (``same``).
    ``without_hooks(module)``: a context manager inside which no hook of the module runs (default
    ``replay_hooks``: all of them set aside but tensor parallelism's)."""
    kwargs = kwargs or {}
    try:
        with contextlib.ExitStack() as stack:
            _replaying(stack, module, rng, call, without_hooks)
            args, kwargs = _copied((tuple(args), dict(kwargs)))
            births = _Births()
            stopped = []
            if target is not None:
                stack.callback(_stop_at(target, births, stopped).remove)
            output = None
            with births:
                try:
                    output = _call_module(module, args, kwargs)
                except _Reached:
                    pass
            result = births.verdict(stopped if target is not None else floating_outputs(output), "forward",
                                    exact_random=rng is not None)
            if run_output is not None and target is None:
                result["same"] = _agrees(floating_outputs(run_output), floating_outputs(output))
            return result
    except Exception as error:  # a replay must never break the run it explains
        return _failed("forward", error)


def arrive_at(module, args, kwargs, rng, call, submodule, index):
    """Run ``module(*args, **kwargs)`` again from ``rng`` (the RNG states at the start of that
    call) under ``call``, nothing read, up to the start of the ``index``-th call (from 0) of
    ``submodule`` inside it: ``(the RNG states there, that call's positional inputs, its keyword
    inputs)``, as the run had them where it is deterministic (the objects a call changes in place
    unseen, a cache, are as they were then); None where it does not get there."""
    arrived = []
    count = [0]

    def arrive(m, a, k):
        if count[0] == index:
            arrived.append((rng_state(), a, k))
            raise _Reached
        count[0] += 1

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(NoCommunication())  # a collective on the way stops it: None
            _replaying(stack, module, rng, call)
            args, kwargs = _copied((tuple(args), dict(kwargs or {})))
            stack.callback(submodule.register_forward_pre_hook(arrive, with_kwargs=True).remove)
            with _Births(reading=False):
                try:
                    _call_module(module, args, kwargs)
                except _Reached:
                    pass
    except Exception:  # noqa: BLE001 - not there: the replay runs from what the run kept
        return None
    return arrived[0] if arrived else None


def holds_objects(args, kwargs):
    """Whether a call's inputs hold objects other than tensors and plain values (a cache): those
    may have changed in place since the call with no version counter to say so."""
    return any(not (isinstance(leaf, (torch.Tensor, *_ATOMS)) or callable(leaf))
               for leaf in pytree.tree_leaves((tuple(args), dict(kwargs or {}))))


@_never_communicates("backward")
def replay_backward(module, args, kwargs, grad_outputs, *, rng=None, call=None, without_hooks=replay_hooks):
    """Replay the forward of ``module(*args, **kwargs)`` with autograd on (inputs copied, each
    requiring a gradient as it did), then its backward with ``grad_outputs`` (one per floating
    tensor of the output, in ``floating_outputs`` order; None where none arrived), with every op
    checked. The gradients are taken with ``torch.autograd.grad`` over the module's parameters and
    the inputs that require one: no ``.grad`` is written. The result names the autograd node that
    made the first nan/inf and the line of its forward op (phase "backward"), or the forward op
    when the nan/inf was already made in the forward. ``rng``, ``call``: as for ``replay_forward``;
    the backward runs without autocast, as training loops run it."""
    kwargs = kwargs or {}
    try:
        with contextlib.ExitStack() as stack:
            _replaying(stack, module, rng, call, without_hooks, backward=True)
            # each node keeps the stack of the forward op that made it
            stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
            args, kwargs = _copied((tuple(args), dict(kwargs)))
            grad_outputs = _copied(list(grad_outputs), requires_grad=False)
            births = _Births()
            with births:
                output = _call_module(module, args, kwargs)
            outputs = floating_outputs(output)
            if len(outputs) != len(grad_outputs):
                return _why("backward", f"not replayed ({len(grad_outputs)} incoming gradients for "
                                        f"{len(outputs)} floating outputs)")
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
            leaves = [p for p in module.parameters() if p.requires_grad]  # the fresh ones
            leaves += [t for t in pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if not pairs or not leaves:
                return _why("backward", "not replayed (no output with an incoming gradient depends "
                                        "on a tensor that requires one)")
            births.phase = "backward"
            with contextlib.ExitStack() as backward:
                _autocast_as(backward, {})
                with births:
                    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                                allow_unused=True)
            return births.verdict([g for g in grads if g is not None], "backward",
                                  exact_random=rng is not None)
    except Exception as error:
        return _failed("backward", error)


# -- the reproducer file ----------------------------------------------------------------------------

class ReproError(Exception):
    """A reproducer file that cannot be written or read; the message names it and says why."""


def repro_path(directory, rank, step):
    """``directory/overflow-rank<r>-step<s>.pt`` (rank 0 in a single process, step 0 unknown)."""
    return os.path.join(directory, f"overflow-rank{rank or 0}-step{step or 0}.pt")


def write_repro(directory, rank, step, module, args, kwargs, grad_outputs, detection, *, rng=None,
                call=None, target=None):
    """Write ``repro_path(directory, rank, step)`` with ``torch.save``: the module (pickled; no
    hook goes with it), copies of the call's inputs and keyword inputs, ``grad_outputs`` for a
    backward (None for a forward), ``rng`` (``rng_state()`` at the call), ``call``
    (``call_state()`` at the call; None: now), ``target`` (``(name of the submodule in module,
    "input" | "output")`` as ``replay_forward`` takes it, or None), the versions of torch and of this
    package, and the detection dict. Classes and functions of the training script itself
    (``__main__``) are written as references to that script's definitions (``script_definitions``),
    so the file replays in a fresh process; where that cannot work, a warning says so and names the
    fix. Returns the path; raises ``ReproError`` naming it when it cannot be written (nothing
    half-written is left)."""
    from .._version import __version__

    path = repro_path(directory, rank, step)
    partial = f"{path}.{os.getpid()}.partial"
    distributed_reason = _held_across_ranks(module, args, kwargs)
    if distributed_reason is not None:
        raise ReproError(f"cannot write the reproducer {path}: {distributed_reason}")
    pickling = _ScriptPickling()
    try:
        payload = {
            "format": REPRO_FORMAT, "format_version": REPRO_VERSION,
            "phase": "forward" if grad_outputs is None else "backward",
            "module": module, "args": _copied(tuple(args)), "kwargs": _copied(dict(kwargs or {})),
            "grad_outputs": None if grad_outputs is None else _copied(list(grad_outputs), requires_grad=False),
            "rng": rng, "call": call if call is not None else call_state(), "target": target,
            "torch_version": torch.__version__, "overflow_fast_version": __version__,
            "rank": rank, "step": step, "detection": detection,
        }
        os.makedirs(directory, exist_ok=True)
        with without_hooks(module):  # the detector's hooks are not the model's
            torch.save(payload, partial, pickle_module=pickling)
        os.replace(partial, path)
    except Exception as error:
        with contextlib.suppress(OSError):
            os.remove(partial)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        raise ReproError(f"cannot write the reproducer {path}: {reason}") from error
    problem = pickling.problem()
    if problem is not None:
        warnings.warn(f"overflow_fast: the reproducer {path} will not replay in a fresh process: {problem}",
                      RuntimeWarning, stacklevel=2)
    return path


def _held_across_ranks(module, args, kwargs):
    """Why a call cannot replay in one process on its own (a reproducer's), or None: DTensors need
    their process group, and FSDP2's classes and hooks cannot be pickled."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:
        FSDPModule = ()
    tensors = list(module.parameters()) + list(module.buffers()) + pytree.tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and local_shard(t) is not t for t in tensors):
        return "the call's tensors are DTensors, held across ranks, and a reproducer replays in one process"
    if FSDPModule and any(isinstance(m, FSDPModule) for m in module.modules()):
        return "FSDP2's fully_shard gave the module a class and hooks of its own, which a file cannot hold"
    return None


def load_repro(path, map_location=None):
    """The dict ``write_repro`` saved. Loading a pickle runs code: load only files you trust.
    Raises ``ReproError`` naming the file when it cannot be read or is not a reproducer."""
    try:
        payload = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        raise ReproError(f"cannot read the reproducer {path}: {reason}") from error
    if not isinstance(payload, dict) or payload.get("format") != REPRO_FORMAT:
        raise ReproError(f"{path} is not an overflow_fast reproducer")
    if payload.get("format_version") != REPRO_VERSION:
        raise ReproError(f"{path} is a reproducer of format {payload.get('format_version')}; "
                         f"this overflow_fast reads format {REPRO_VERSION}")
    return payload


def replay_repro(payload):
    """Replay what a loaded reproducer holds; the result of ``replay_forward``/``replay_backward``."""
    module, args, kwargs = payload["module"], payload["args"], payload["kwargs"]
    options = {"rng": payload.get("rng"), "call": payload.get("call")}
    if payload["phase"] == "backward":
        return replay_backward(module, args, kwargs, payload["grad_outputs"], **options)
    target = payload.get("target")
    if target is not None:
        name, side = target
        options["target"] = (module.get_submodule(name), side)
    return replay_forward(module, args, kwargs, **options)


# -- the training script's own classes in a reproducer -----------------------------------------------
#
# A class defined in the script being run lives in ``__main__``, which pickle writes by reference:
# in another process ``__main__`` is another program. The file refers to the script instead, and a
# fresh process runs the script's definitions alone (its imports, classes, functions and constant
# assignments), never the training the rest of it runs.

_SCRIPTS = {}  # (path, package) -> the module of a script's definitions, loaded once per process


def _main_script():
    """(path, package) of the script running as ``__main__``, or None (an interactive session)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return None
    spec = getattr(main, "__spec__", None)
    package = spec.parent if spec is not None and spec.parent else None
    return os.path.abspath(path), package


class _ScriptPickling:
    """``torch.save``'s pickle module: writes the ``__main__`` classes and functions it meets as
    ``script_definition(script, qualified name)``; ``problem()`` says why the file could still not
    replay elsewhere (None when it can)."""

    def __init__(self):
        self.__name__ = "pickle"
        self.script = _main_script()
        self.names = []  # the qualified names of the __main__ objects written
        pickling = self

        class Pickler(pickle.Pickler):
            def reducer_override(self, obj):
                # (a lambda or a class defined inside a function cannot be referred to: pickle says so)
                if (isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__"
                        and "<" not in obj.__qualname__):
                    if obj.__qualname__ not in pickling.names:
                        pickling.names.append(obj.__qualname__)
                    if pickling.script is not None:
                        return script_definition, (pickling.script, obj.__qualname__)
                return NotImplemented

        self.Pickler = Pickler

    def problem(self):
        if not self.names:
            return None
        defined = ", ".join(self.names)
        if self.script is None:
            return (f"{defined} are defined in an interactive session (__main__ has no file): define them in a "
                    "module and import them")
        try:
            with open(self.script[0], encoding="utf-8") as source:
                tree = ast.parse(source.read(), self.script[0])
        except (OSError, SyntaxError, ValueError) as error:
            return f"cannot read the script {self.script[0]} that defines {defined}: {error}"
        missing = _not_defined(tree, self.names)
        if missing:
            return (f"{', '.join(missing)} in {self.script[0]} are not top-level definitions, or read names that "
                    "the script sets by running code (a replay runs only its imports, classes, functions and "
                    "assignments that call nothing): define them in a module and import them")
        return None


def _definitions(tree):
    """The top-level statements of a script that only define: imports, classes, functions and
    assignments that call nothing (``if __name__ == "__main__":`` and the training loop are left out)."""
    kept = []
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kept.append(statement)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None and not any(
                isinstance(node, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr))
                for node in ast.walk(statement.value)):
            kept.append(statement)
    return kept


def _bound_names(statement):
    if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return {node.id for target in targets if target is not None for node in ast.walk(target)
            if isinstance(node, ast.Name)}


def _not_defined(tree, names):
    """Those of ``names`` (qualified) that the script's definitions do not give, or whose code
    reads a top-level name that only the rest of the script sets."""
    kept = _definitions(tree)
    defined = {name for statement in kept for name in _bound_names(statement)}
    run_only = {name for statement in tree.body if statement not in kept for name in _bound_names(statement)
                if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign))} - defined
    by_name = {statement.name: statement for statement in kept if hasattr(statement, "name")}
    missing = []
    for name in names:
        top = name.split(".")[0]
        statement = by_name.get(top)
        if top not in defined or (statement is not None and any(
                isinstance(node, ast.Name) and node.id in run_only for node in ast.walk(statement))):
            missing.append(name)
    return missing


def script_definition(script, qualname):
    """The class or function ``qualname`` of a training script, from its definitions alone (what a
    reproducer refers to instead of ``__main__``). ``script``: (path, package)."""
    module = _SCRIPTS.get(script)
    if module is None:
        module = _SCRIPTS[script] = _load_definitions(*script)
    value = module
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _load_definitions(path, package):
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError) as error:
        raise ReproError(f"cannot read the training script {path} whose classes the reproducer holds: {error}") \
            from error
    name = f"__overflow_fast_script_{len(_SCRIPTS)}__"
    module = types.ModuleType(name)
    module.__file__ = path
    module.__package__ = package
    sys.modules[name] = module  # dataclasses and pickle look classes' modules up there
    folder = os.path.dirname(path)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)  # the script's own imports of its neighbours
    try:
        code = compile(ast.Module(body=_definitions(tree), type_ignores=[]), path, "exec")
        exec(code, module.__dict__)  # noqa: S102 - the definitions of a script the user trusts, as a pickle is
    finally:
        if added:
            sys.path.remove(folder)
    return module
