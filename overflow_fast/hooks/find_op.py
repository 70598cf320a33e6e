"""The op and the line of code that made the first nan/inf of one module call, found by replaying
that call alone with every op checked; and the reproducer file that replays it in another process.

``replay_forward(module, args, kwargs)`` runs ``module(*args, **kwargs)`` once under a
``TorchDispatchMode`` that reads every op's inputs before the op and its outputs after it.
``replay_backward(module, args, kwargs, grad_outputs)`` replays the forward the same way with
autograd on, then its backward with the call's incoming gradients. An op whose output holds a
nan/inf while everything it read was finite *made* that nan/inf; an op that read one passes on where
it came from (kept per storage, so writes through views count). The answer is where the nan/inf in
the replayed call's result came from, so an inf made and then dropped on the way (the ``exp`` of a
hand-written softplus in the branch that ``where`` does not take) is not blamed.

Each returns a dict: ``{"op", "file", "line", "phase", "what"}``, e.g. ``{"op": "aten.exp", "file":
"/home/me/model.py", "line": 42, "phase": "forward", "what": "inf from finite inputs (input abs max
8.9e+01)"}``. In backward ``op`` is the autograd node that ran the op (``SqrtBackward0``) and the
line is that of its forward op. ``file:line`` is the innermost frame of the replayed call that lies
outside torch's package and this one, or None when there is none (an ``nn.Linear`` replayed alone
runs only torch's code: the caller knows the line that called the module). Where the replay cannot
show it: ``{"op": None, "phase", "why"}``, the reason in words; it never guesses. ``op_line(result)``
is the report's line.

The replay leaves the run as it was: the module's buffers are replaced by copies for the replay
(BatchNorm's running statistics in train mode), its attributes and its parameters' and inputs'
contents are untouched (inputs are copied), no ``.grad`` is written (``torch.autograd.grad``), the
CPU and CUDA RNG states are restored, no autograd graph outlives it, no forward or backward hook
of the module, its submodules or the global ones runs (but tensor parallelism's, which hold no
state), and nothing is sent to other ranks: a collective stops the replay before it runs
(``_never_communicates``). The memory it takes while it runs: a copy of
the call's inputs and of the module's buffers, the replayed call's activations, and for backward its
gradients; nothing is kept after.
"""

import contextlib
import copy
import functools
import math
import os
import re
import sys
import warnings
from collections import OrderedDict

import torch
import torch.nn.modules.module as _torch_module
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed import NoCommunication, active_guard, communicating, holds_sharded_parameters, local_shard

REPRO_FORMAT = "overflow_fast reproducer"
REPRO_VERSION = 1

NOT_REPRODUCED = "not reproduced on replay (no op made a nan/inf from finite inputs)"
ALREADY_IN = "not reproduced on replay (the nan/inf was already in"

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
    """``Op: aten.exp at /home/me/model.py:42: inf from finite inputs (input abs max 8.9e+01)``;
    without a location ``Op: aten.addmm: inf from ...``; where there is no answer ``Op: <why>``."""
    if result.get("op") is None:
        return f"Op: {result['why']}"
    where = f" at {result['file']}:{result['line']}" if result.get("file") else ""
    return f"Op: {result['op']}{where}: {result['what']}"


def _why(phase, why):
    return {"op": None, "phase": phase, "why": why}


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
    cloned (``requires_grad`` as they had, with ``requires_grad``), shared ones still shared; other
    objects deep-copied (a cache the call appends to), modules and plain values as they are."""
    memo = {}
    leaves, spec = pytree.tree_flatten(value)
    copies = []
    with torch.no_grad():
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in memo:
                    clone = leaf.detach().clone()
                    if requires_grad and leaf.requires_grad:
                        clone.requires_grad_(True)
                    memo[id(leaf)] = clone
                copies.append(memo[id(leaf)])
            elif isinstance(leaf, _ATOMS) or callable(leaf):
                copies.append(leaf)
            else:
                copies.append(copy.deepcopy(leaf, memo))
    return pytree.tree_unflatten(copies, spec)


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
    came from (``origins``), and which random ops ran (``random_ops``, with their order)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.seq = 0
        self.origins = {}
        self.random_ops = []
        self.guard = active_guard() or NoCommunication()  # the replay's
        if self.guard.on_refuse is None:
            self.guard.on_refuse = self._refused

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
            if randoms and not exact_random:
                return _why(phase, f"not reproduced on replay (random ops: {', '.join(randoms)})")
            return _why(phase, NOT_REPRODUCED)
        origin = min((self.origins.get(_storage_key(t), _OUTSIDE) for t in bad), key=lambda o: o["seq"])
        if origin["kind"] == "outside":
            made_from = ("its inputs, parameters, buffers or incoming gradients" if phase == "backward"
                         else "its inputs, parameters or buffers")
            return _why(phase, f"{ALREADY_IN} {made_from})")
        earlier = list(dict.fromkeys(name for seq, name in self.random_ops if seq < origin["seq"]))
        if earlier and not exact_random:
            return _why(origin["phase"], f"not reproduced on replay (random ops: {', '.join(earlier)})")
        where = f" at {origin['file']}:{origin['line']}" if origin["file"] else ""
        if origin["kind"] == "constant":
            return _why(origin["phase"], f"the nan/inf comes from a non-finite constant ({origin['op']}{where})")
        if origin["kind"] == "uninitialized":
            return _why(origin["phase"], f"the nan/inf comes from uninitialized memory ({origin['op']}{where})")
        return {"op": origin["op"], "file": origin["file"], "line": origin["line"],
                "phase": origin["phase"], "what": origin["what"]}


def _tensors_out(result):
    return [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]


# -- the replays -------------------------------------------------------------------------------------

def _failed(phase, error):
    message = str(error).strip().splitlines()
    return _why(phase, f"not replayed ({type(error).__name__}: {message[0] if message else ''})")


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
def replay_forward(module, args=(), kwargs=None, *, rng=None, call=None, without_hooks=replay_hooks):
    """Replay ``module(*args, **kwargs)`` alone with every op checked; the result as the module's
    docstring says (phase "forward").

    ``rng``: the RNG states taken just before the call (``rng_state()``); with it random ops
    (dropout) replay exactly, without it a nan/inf made after a random op is not reported (the
    replay drew other numbers). ``call``: ``call_state()`` taken at the call (grad mode, autocast);
    None runs under the current ones. ``without_hooks(module)``: a context manager inside which no
    hook of the module runs (default ``replay_hooks``: all of them set aside but tensor
    parallelism's)."""
    kwargs = kwargs or {}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(without_hooks(module))
            stack.enter_context(_module_kept(module, fresh_parameters=False))
            stack.enter_context(_rng_kept(rng))
            if call is not None:
                stack.enter_context(torch.set_grad_enabled(call["grad_enabled"]))
                _autocast_as(stack, call.get("autocast") or {})
            args, kwargs = _copied((tuple(args), dict(kwargs)))
            births = _Births()
            with births:
                output = _call_module(module, args, kwargs)
            return births.verdict(floating_outputs(output), "forward", exact_random=rng is not None)
    except Exception as error:  # a replay must never break the run it explains
        return _failed("forward", error)


@_never_communicates("backward")
def replay_backward(module, args, kwargs, grad_outputs, *, rng=None, call=None, without_hooks=replay_hooks):
    """Replay the forward of ``module(*args, **kwargs)`` with autograd on (inputs copied, each
    requiring a gradient as it did), then its backward with ``grad_outputs`` (one per floating
    tensor of the output, in ``floating_outputs`` order; None where none arrived), with every op
    checked. The gradients are taken with ``torch.autograd.grad`` over the module's parameters and
    the inputs that require one: no ``.grad`` is written. The result names the autograd node that
    made the first nan/inf and the line of its forward op (phase "backward"), or the forward op
    when the nan/inf was already made in the forward. ``rng``, ``call``, ``without_hooks``: as for
    ``replay_forward``; the backward runs without autocast, as training loops run it."""
    kwargs = kwargs or {}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(without_hooks(module))
            stack.enter_context(_module_kept(module, fresh_parameters=True))
            stack.enter_context(_rng_kept(rng))
            if call is not None:
                _autocast_as(stack, call.get("autocast") or {})
            stack.enter_context(torch.enable_grad())
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
                call=None):
    """Write ``repro_path(directory, rank, step)`` with ``torch.save``: the module (pickled; no
    hook goes with it), copies of the call's inputs and keyword inputs, ``grad_outputs`` for a
    backward (None for a forward), ``rng`` (``rng_state()`` at the call) and ``call``
    (``call_state()`` at the call; None: now), the versions of torch and of this package, and the
    detection dict. Returns the path; raises ``ReproError`` naming it when it cannot be written
    (nothing half-written is left)."""
    from .. import __version__

    path = repro_path(directory, rank, step)
    partial = f"{path}.{os.getpid()}.partial"
    distributed_reason = _held_across_ranks(module, args, kwargs)
    if distributed_reason is not None:
        raise ReproError(f"cannot write the reproducer {path}: {distributed_reason}")
    try:
        payload = {
            "format": REPRO_FORMAT, "format_version": REPRO_VERSION,
            "phase": "forward" if grad_outputs is None else "backward",
            "module": module, "args": _copied(tuple(args)), "kwargs": _copied(dict(kwargs or {})),
            "grad_outputs": None if grad_outputs is None else _copied(list(grad_outputs), requires_grad=False),
            "rng": rng, "call": call if call is not None else call_state(),
            "torch_version": torch.__version__, "overflow_fast_version": __version__,
            "rank": rank, "step": step, "detection": detection,
        }
        os.makedirs(directory, exist_ok=True)
        with without_hooks(module):  # the detector's hooks are not the model's
            torch.save(payload, partial)
        os.replace(partial, path)
    except Exception as error:
        with contextlib.suppress(OSError):
            os.remove(partial)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else f"{type(error).__name__}: {error}"
        raise ReproError(f"cannot write the reproducer {path}: {reason}") from error
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
    return replay_forward(module, args, kwargs, **options)
