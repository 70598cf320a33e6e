"""What one hook call records: its entries (parameters, inputs, outputs) in the reference's order and
naming, and, once read, a frame of raw statistics rows. Text is built only when printed
(``text.frame_text``)."""

import dataclasses
import sys

import torch

from . import text
from .._compat import is_dataclass_instance
from .text import NONE, NOT_A_TENSOR, TENSOR, UNREADABLE
from ..stats import unreadable_reason
from ..stats.kinds import PLAIN_TYPES, SUPPORTED_DTYPES

FORWARD, BACKWARD = "forward", "backward"
graph_task_id = torch._C._current_graph_task_id  # the backward pass running on this thread; -1 outside one

# where a backward enters autograd's engine from Python (torch.autograd.backward and grad)
_ENGINE_ENTRY = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)
# the frames a checkpoint's recompute runs under: torch.utils.checkpoint's non-reentrant unpack hook
# and recompute function, and the backward of a checkpoint Function (torch's reentrant one,
# DeepSpeed's, Megatron's), each with "checkpoint" in its qualified name
_RECOMPUTE_NAMES = frozenset({"unpack_hook", "recompute_fn", "backward"})


def recomputing():
    """Whether the forward call running now inside a backward (``graph_task_id() != -1``) is activation
    checkpointing's recompute of an earlier forward (it counts no batch; the backward pass decides it),
    rather than a forward of its own that the backward runs, such as a probe network called in a
    gradient hook (a pass like any other, counted as the reference counts it). A recompute runs under
    a checkpoint's frames with no entry into autograd's engine in between: a hook that a reentrant
    checkpoint's inner backward runs is not its recompute. Walks this thread's stack: asked only
    inside a backward."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _ENGINE_ENTRY:
            return False
        if code.co_name in _RECOMPUTE_NAMES and "checkpoint" in getattr(code, "co_qualname", code.co_filename).lower():
            return True
        frame = frame.f_back
    return False


class Frame:
    """One hook call: the module, its entries, and their statistics rows (raw, not text)."""

    __slots__ = ("lead", "module_name", "class_name", "entries", "dtypes", "rows", "phase", "consumers",
                 "bad_shards", "kept_call", "tensors", "sources", "incoming_read", "computed_in")

    def __init__(self, module_name, class_name, entries, dtypes, phase=FORWARD, consumers=None):
        self.lead = ()  # lines the reference had waiting in `self.frame` (batch markers)
        self.module_name = module_name
        self.class_name = class_name
        self.entries = entries  # (kind, ctx, payload): payload is a row index for TENSOR
        self.dtypes = dtypes
        self.rows = None  # host rows, one per TENSOR entry
        self.phase = phase
        self.consumers = consumers  # an output gradient's frame: the modules whose backward produced it
        self.bad_shards = None  # row index -> ranks whose DTensor shard of it holds a nan/inf
        self.kept_call = None  # find_op: the call's inputs (culprit.KeptCall), for its replay
        self.tensors = None  # a call decided in its hook that detects: its tensors, for the Where line
        self.sources = None  # a call that detects: where its rows are (reads.Reads.unchanged asks there)
        # a detection in parameters' gradients: whether the gradient arriving at the module's
        # outputs was read before (None: not asked)
        self.incoming_read = None
        self.computed_in = None  # under autocast, the dtype the call computed in (its wider entries were cast to it)

    def tensor_entries(self):
        """``(ctx, row, dtype)`` of every tensor entry."""
        return [(ctx, self.rows[payload], self.dtypes[payload])
                for kind, ctx, payload in self.entries if kind == TENSOR]

    def __str__(self):
        return text.frame_text(self)

    def mark_bad_shards(self, index, ranks):
        """The DTensor at row ``index`` holds a nan/inf in the shards of these ranks."""
        if self.bad_shards is None:
            self.bad_shards = {}
        self.bad_shards[index] = ranks

    def mark_unreadable(self, index, reason):
        """The tensor at row ``index`` could not be read after all: give it the unreadable line."""
        self.entries = [(UNREADABLE, ctx, reason) if kind == TENSOR and payload == index else (kind, ctx, payload)
                        for kind, ctx, payload in self.entries]


_CLASS_NAMES = {}


def class_name(module):
    """The module's class name as the user wrote it: FSDP2's ``fully_shard`` (and ``replicate``)
    swap a module's class for a generated ``FSDPLinear(FSDPModule, Linear)``; frames keep
    ``Linear``, so that a sharded run prints what an unsharded one does."""
    cls = type(module)
    name = _CLASS_NAMES.get(cls)
    if name is None:
        name = cls.__name__
        bases = cls.__bases__
        if (len(bases) == 2 and bases[0].__module__.startswith("torch.distributed")
                and name != bases[1].__name__ and name.endswith(bases[1].__name__)):
            name = bases[1].__name__
        _CLASS_NAMES[cls] = name
    return name


_named_parameters = torch.nn.Module.named_parameters


def parameters_listed_as_torch(module_type):
    """Whether modules of ``module_type`` list their own parameters as ``torch.nn.Module`` does (its
    ``named_parameters``): their ``_parameters`` are then the list (``own_parameters``)."""
    return getattr(module_type, "named_parameters", None) is _named_parameters


def own_parameters(module):
    """``(parameter, name)`` for ``module.named_parameters(recurse=False)``, as the reference lists
    them; without the generator machinery when the module does not override it (it runs per hook)."""
    if type(module).named_parameters is _named_parameters:
        parameters = module._parameters
        if not parameters:  # most modules (no list comprehension's call for them)
            return []
        pairs = [(p, name) for name, p in parameters.items() if p is not None]
        count = len(pairs)
        if count < 2 or (pairs[0][0] is not pairs[1][0] if count == 2 else len({id(p) for p, _ in pairs}) == count):
            return pairs
    # overridden, or one tensor under two names (the first wins)
    return [(p, name) for name, p in module.named_parameters(recurse=False)]


_INPUT_NAMES = [f"input[{i}]" for i in range(16)]
_OUTPUT_NAMES = [f"output[{i}]" for i in range(16)]


def forward_items(module, input, output, kwargs=None, containers=False):
    """``(value, ctx)`` of one forward hook call, in the reference's order: own parameters, the
    positional inputs, (``kwargs``) keyword tensors as ``input[name]``, the outputs (one level of
    nested tuples). ``containers``: values the reference prints as ``not a tensor`` (dicts, lists,
    ModelOutputs, dataclasses, deeper tuples) are opened instead, one item per tensor inside, named
    by its path (``output[loss]``, ``output[1][0][2]``)."""
    items = own_parameters(module)
    _add_inputs(items, input, kwargs, containers)
    _add_outputs(items, output)
    return _opened(items) if containers else items


def input_items(input, kwargs=None, containers=False):
    """``(value, ctx)`` of a forward call's inputs alone, named as ``forward_items`` names them."""
    items = []
    _add_inputs(items, input, kwargs, containers)
    return _opened(items) if containers else items


def _add_inputs(items, input, kwargs, containers):
    if isinstance(input, tuple):
        names = _INPUT_NAMES if len(input) <= len(_INPUT_NAMES) else [f"input[{i}]" for i in range(len(input))]
        items.extend(zip(input, names))
    else:
        items.append((input, "input"))
    if kwargs:
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) or (containers and _holds_tensors(value)):
                items.append((value, f"input[{name}]"))


def output_items(output, containers=False):
    """``(value, ctx)`` of a forward call's output alone, named as ``forward_items`` names them."""
    items = []
    _add_outputs(items, output)
    return _opened(items) if containers else items


def _add_outputs(items, output):
    if isinstance(output, tuple):
        for i, x in enumerate(output):
            if isinstance(x, tuple):
                items.extend((y, f"output[{i}][{j}]") for j, y in enumerate(x))
            else:
                items.append((x, _OUTPUT_NAMES[i] if i < len(_OUTPUT_NAMES) else f"output[{i}]"))
    else:
        items.append((output, "output"))


def _opened(items):
    # (a tensor or None is its own one leaf: no call for it)
    return [leaf for var, ctx in items
            for leaf in (((var, ctx),) if var is None or isinstance(var, _Tensor) else _open(var, ctx))]


def container_leaves(value, ctx, keyword):
    """With ``containers``, the items ``forward_items`` makes of one value that is neither a tensor nor
    None: its tensors by path where it holds any; else the value itself, or nothing for a keyword."""
    if keyword:
        return _open(value, ctx) if _holds_tensors(value) else []
    return _open(value, ctx)


_MAX_DEPTH = 8


def _children(value):
    """``(key, child)`` of a container, or None for anything else (tensors, scalars, objects)."""
    if isinstance(value, (torch.Tensor, str, bytes)):
        return None
    if isinstance(value, dict):  # ModelOutput is an OrderedDict of its set fields
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    if is_dataclass_instance(value):
        return [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    return None


def opens_nothing(kind):
    """Whether ``_children`` is None for every value of the type ``kind`` (it asks nothing of a value
    but its type): such values are never opened. The C++ entries ask it once per type."""
    if issubclass(kind, (torch.Tensor, str, bytes)):
        return True
    if issubclass(kind, (dict, list, tuple)):
        return False
    return issubclass(kind, type) or getattr(kind, "__dataclass_fields__", None) is None


def _holds_tensors(value, depth=0):
    if isinstance(value, torch.Tensor):
        return True
    children = _children(value) if depth < _MAX_DEPTH else None
    # not bool(children): torch 2.11's dynamo cannot trace bool() of a list
    return children is not None and any(_holds_tensors(child, depth + 1) for _, child in children)


def _open(value, ctx, depth=0):
    """The ``(tensor, path)`` leaves of a container that holds tensors; other values as they are."""
    if depth == 0 and not _holds_tensors(value):
        return [(value, ctx)]
    children = _children(value) if depth < _MAX_DEPTH else None
    if children is None:
        return [(value, ctx)] if isinstance(value, torch.Tensor) else []
    return [leaf for key, child in children for leaf in _open(child, f"{ctx}[{key}]", depth + 1)]


_Tensor = torch.Tensor
_STRIDED = torch.strided
_functorch = torch._C._functorch
transform_level = _functorch.maybe_current_level  # not None inside torch.func's grad, vmap, functionalize...


def untransformed(tensor):
    """The values of a tensor made inside a torch.func transform: the plain tensor under its wrappers
    (under vmap, every instance of the batch at once), or why it cannot be read (a string). Call it
    with functorch's dispatch off (``torch._C._DisableFuncTorch``): nothing is written, and what the
    engine allocates stays a plain tensor."""
    try:
        while _functorch.is_functorch_wrapped_tensor(tensor):
            if _functorch.is_functionaltensor(tensor):
                torch._sync(tensor)  # functionalize applies pending in-place updates lazily
            tensor = _functorch.get_unwrapped(tensor)
    except Exception as error:  # noqa: BLE001 - a wrapper torch cannot open: a line, not a crash
        return f"a torch.func transform's tensor that cannot be unwrapped ({type(error).__name__}: {error})"[:200]
    return tensor


def entries_of(items, transformed=False):
    """The entries of ``(value, ctx)`` items, the tensors among them that the engine reads (in row
    order) and their dtypes. A tensor the engine cannot read gets an UNREADABLE entry (its reason
    as payload) and no row. ``transformed``: inside a torch.func transform (``untransformed``).
    Entries and dtypes are tuples: a call keeps them until its pass is decided, and tuples of
    atomic items are nothing the collector traverses (it untracks them), where lists would be."""
    entries = []
    tensors = []
    dtypes = []
    entry, tensor, dtype_of = entries.append, tensors.append, dtypes.append  # (this runs at every hook)
    for var, ctx in items:
        if transformed and isinstance(var, _Tensor):
            var = untransformed(var)
            if isinstance(var, str):
                entry((UNREADABLE, ctx, var))
                continue
        plain = type(var) in PLAIN_TYPES  # (a tensor: asked first, it spares the isinstance)
        if plain or isinstance(var, _Tensor):
            dtype = var.dtype
            # the common case without a call: a plain strided tensor of a supported dtype
            if not (plain and dtype in SUPPORTED_DTYPES and var.layout is _STRIDED
                    and not var.is_meta and not var.is_nested):
                reason = unreadable_reason(var)
                if reason is not None:
                    entry((UNREADABLE, ctx, reason))
                    continue
            entry((TENSOR, ctx, len(tensors)))
            tensor(var)
            dtype_of(dtype)
        elif var is None:
            entry((NONE, ctx, None))
        else:
            entry((NOT_A_TENSOR, ctx, None))
    return tuple(entries), tensors, tuple(dtypes)
