"""The op and the line of code that made the first nan/inf of one module call, found by replaying
that call alone with every op checked (``repro`` writes the same replay into a file).

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

The replay runs in the sandbox (``sandbox``) and leaves the run as it was: the module's buffers
are copies for the replay (BatchNorm's running statistics in train mode), its attributes and its
parameters' and inputs' contents are untouched (inputs are copied, and so are the objects they
hold: a cache the call appends to), no ``.grad`` is written (``torch.autograd.grad``), the RNG
states are restored, no autograd graph outlives it, no hook runs but tensor parallelism's, and
nothing is sent to other ranks: a collective stops the replay before it runs
(``_never_communicates``). The memory it takes while it runs: a copy of the call's inputs and of the module's buffers, the
replayed call's activations, and for backward its gradients; nothing is kept after.
"""

import contextlib
import functools
import math
import os
import re
import sys
import warnings

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed import NoCommunication, active_guard, communicating, local_shard
from .sandbox import autocast_as, copied, entered, replay_hooks, rng_state, sharded_for_the_call

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
                        ("hooks", "replay", "stats", "recording", "report", "distributed", "integrations"))
_THIS_FILE = os.path.realpath(__file__)


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
        self.names = {}  # id -> name of the replayed call's parameters, buffers and inputs (a cast names its tensor)
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
            what = _cast(short, read_floating, read_max, bad_outputs, self.names)
            if what is None:
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

    def verdict(self, results, phase, exact_random, private=()):
        """Where the first nan/inf among ``results`` (the replayed call's outputs, or gradients)
        came from, as the module's docstring says. ``private``: the ops that drew from a private
        ``torch.Generator`` (``sandbox.PrivateGenerators``), whose draws cannot be the run's."""
        exact_random = exact_random and not private
        randoms = list(dict.fromkeys(_drawn(name, private) for _, name in self.random_ops))
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
        earlier = list(dict.fromkeys(_drawn(name, private) for seq, name in self.random_ops if seq < origin["seq"]))
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


_CASTS = frozenset({"_to_copy", "to", "copy_", "_autocast_to_reduced_precision", "_autocast_to_full_precision"})


def _cast(short, read, read_max, bad_outputs, names):
    """How a cast made a nan/inf of finite values (``autocast`` casting an fp32 weight to float16):
    the tensor cast (by name where it is a parameter, a buffer or an input of the replayed call),
    the dtype, the value that did not fit and that dtype's largest; None for another op."""
    if short not in _CASTS or not read or not bad_outputs:
        return None
    target = bad_outputs[0].dtype
    if not target.is_floating_point or read[0].dtype == target:
        return None
    dtype = str(target).replace("torch.", "")
    name = names.get(id(read[0]))
    largest = torch.finfo(target).max
    cast = f"{name} cast to {dtype}" if name else f"a cast to {dtype}"
    value = f"abs max {read_max[0]:.1e}" if read_max[0] is not None else "a value"
    return (f"{cast}: {_nonfinite_kinds(bad_outputs)} from finite values ({value}, beyond {dtype}'s largest, "
            f"{largest:.1e})")


def _names_of(module, args, kwargs):
    """The replayed call's tensors by id: its parameters and buffers by their names in it
    (``weight``, ``1.bias``), its inputs as its frame names them (``input[0]``, ``input[mask]``)."""
    names = {id(t): name for name, t in module.named_buffers()}
    names.update((id(t), name) for name, t in module.named_parameters())
    names.update((id(t), f"input[{i}]") for i, t in enumerate(args) if isinstance(t, torch.Tensor))
    names.update((id(t), f"input[{k}]") for k, t in (kwargs or {}).items() if isinstance(t, torch.Tensor))
    return names


def _drawn(name, private):
    return f"{name} from a private torch.Generator" if name in private else name


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


def agrees(run, replayed):
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



def _never_communicates(phase):
    """A replay on one rank must never run a collective (it would pair with the other ranks' next
    one, or wait for ever): it runs inside a guard that stops the first before it sends anything,
    and then says so, whatever the replay made of the error; with what it had seen before, where
    that collective would read a nan/inf. A module whose parameters FSDP2 sharded again after the
    call is not replayed: gathering them would communicate."""
    def decorate(replay):
        @functools.wraps(replay)
        def guarded(module, *args, **kwargs):
            gathered = sharded_for_the_call(module)
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
            generators = entered(stack, module, rng, call, without_hooks)
            args, kwargs = copied((tuple(args), dict(kwargs)))
            births = _Births()
            births.names = _names_of(module, args, kwargs)
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
                                    exact_random=rng is not None, private=generators.drawn)
            if run_output is not None and target is None:
                result["same"] = agrees(floating_outputs(run_output), floating_outputs(output))
            return result
    except Exception as error:  # a replay must never break the run it explains
        return _failed("forward", error)


def arrive_at(module, args, kwargs, rng, call, submodule, index, end=False):
    """Run ``module(*args, **kwargs)`` again from ``rng`` (the RNG states at the start of that
    call) under ``call``, nothing read, up to the start of the ``index``-th call (from 0) of
    ``submodule`` inside it: ``(the RNG states there, that call's positional inputs, its keyword
    inputs)``, as the run had them where it is deterministic (the objects a call changes in place
    unseen, a cache, are as they were then); None where it does not get there. ``end``: up to the
    end of that call instead, ``(None, its positional inputs, keyword inputs, output)`` then."""
    arrived = []
    count = [0]
    running = []  # the ordinals of the submodule's calls running (a module may call itself)

    def arrive(m, a, k):
        if count[0] == index and not end:
            arrived.append((rng_state(), a, k))
            raise _Reached
        running.append(count[0])
        count[0] += 1

    def returned(m, a, k, output):
        if running.pop() == index:
            arrived.append((None, a, k, output))
            raise _Reached

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(NoCommunication())  # a collective on the way stops it: None
            entered(stack, module, rng, call)
            args, kwargs = copied((tuple(args), dict(kwargs or {})))
            stack.callback(submodule.register_forward_pre_hook(arrive, with_kwargs=True).remove)
            if end:
                stack.callback(submodule.register_forward_hook(returned, with_kwargs=True).remove)
            with _Births(reading=False):
                try:
                    _call_module(module, args, kwargs)
                except _Reached:
                    pass
    except Exception:  # noqa: BLE001 - not there: the replay runs from what the run kept
        return None
    return arrived[0] if arrived else None



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
            generators = entered(stack, module, rng, call, without_hooks, backward=True)
            # each node keeps the stack of the forward op that made it
            stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
            args, kwargs = copied((tuple(args), dict(kwargs)))
            grad_outputs = copied(list(grad_outputs), requires_grad=False)
            births = _Births()
            births.names = _names_of(module, args, kwargs)
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
                autocast_as(backward, {})
                with births:
                    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                                allow_unused=True)
            return births.verdict([g for g in grads if g is not None], "backward",
                                  exact_random=rng is not None, private=generators.drawn)
    except Exception as error:
        return _failed("backward", error)


