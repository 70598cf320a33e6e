"""What one hook call records: a frame of entries (parameters, inputs, outputs) in the reference's
order and naming, with raw statistics rows instead of text. Text is built only when printed
(``report.frame_text``)."""

import collections
import dataclasses

import torch

from . import native, report
from .report import NONE, NOT_A_TENSOR, TENSOR, UNREADABLE
from .stats import unreadable_reason
from .stats.kinds import PLAIN_TYPES, SUPPORTED_DTYPES


FORWARD, BACKWARD = "forward", "backward"
_STRIDED = torch.strided
_Tensor = torch.Tensor


class Frame:
    """One hook call: the module, its entries, and their statistics rows (raw, not text)."""

    __slots__ = ("lead", "module_name", "class_name", "entries", "dtypes", "rows", "phase", "consumers",
                 "bad_shards")

    def __init__(self, module_name, class_name, entries, dtypes, phase=FORWARD):
        self.lead = ()  # lines the reference had pending in `self.frame` (batch markers)
        self.module_name = module_name
        self.class_name = class_name
        self.entries = entries  # (kind, ctx, payload): payload is a row index for TENSOR
        self.dtypes = dtypes
        self.rows = None  # host rows (while pending with check="batch", some are (device, slot))
        self.phase = phase
        self.consumers = None  # an output gradient's frame: the modules whose backward produced it
        self.bad_shards = None  # row index -> ranks whose DTensor shard of it holds a nan/inf (made when needed)

    def tensor_entries(self):
        """``(ctx, row, dtype)`` of every tensor entry, once the rows are on the host."""
        return [(ctx, self.rows[payload], self.dtypes[payload])
                for kind, ctx, payload in self.entries if kind == TENSOR]

    def __str__(self):
        return report.frame_text(self)

    def mark_bad_shards(self, index, ranks):
        """The DTensor at row ``index`` holds a nan/inf in the shards of these ranks."""
        if self.bad_shards is None:
            self.bad_shards = {}
        self.bad_shards[index] = ranks

    def mark_unreadable(self, index, reason):
        """The tensor at row ``index`` could not be read after all: give it the unreadable line."""
        for position, (kind, ctx, payload) in enumerate(self.entries):
            if kind == TENSOR and payload == index:
                self.entries[position] = (UNREADABLE, ctx, reason)


# A hook call as the reference's state machine sees it, replayed once its rows are known.
Call = collections.namedtuple("Call", ("frame", "trace_mode", "first_call", "last_frame_of_batch", "batch_before",
                                       "batch_after", "total_calls"))


def _python_call(*fields):
    """``Call(*fields)``, without namedtuple's Python-level __new__."""
    return tuple.__new__(Call, fields)


def _ctx(name, count):
    return [f"{name}[{i}]" for i in range(count)]


_INPUT_CTX = native.INPUT_NAMES
_OUTPUT_CTX = native.OUTPUT_NAMES
_CTX_CACHE = len(_INPUT_CTX)
_named_parameters = torch.nn.Module.named_parameters


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


def own_parameters(module):
    """``(parameter, name)`` for ``module.named_parameters(recurse=False)``, as the reference lists
    them; without the generator machinery when the module does not override it (it runs per hook)."""
    if type(module).named_parameters is _named_parameters:
        pairs = [(p, name) for name, p in module._parameters.items() if p is not None]
        count = len(pairs)
        if count < 2 or (pairs[0][0] is not pairs[1][0] if count == 2 else len({id(p) for p, _ in pairs}) == count):
            return pairs
    # overridden, or one tensor under two names (the first wins)
    return [(p, name) for name, p in module.named_parameters(recurse=False)]


def hook_frame(module_names, module, input, output, kwargs=None, containers=False):
    """``forward_frame`` of a hooked module, named as ``module_names`` (the detector's) names it:
    one C call with the extension, for every call shape it takes."""
    if native.hook_frame is not None:
        found = native.hook_frame(module_names, module, input, output, kwargs or None, containers)
        if found is not None:
            return found
    return forward_frame(module_names.get(module, "?"), module, input, output, kwargs, containers)


def forward_frame(module_name, module, input, output, kwargs=None, containers=False):
    """The frame of one forward hook call (entries in the reference's order) and its readable
    tensors, in row order.

    ``kwargs``: the call's keyword arguments, whose tensors get ``input[name]`` lines after the
    positional inputs. ``containers``: values the reference prints as ``not a tensor`` (dicts,
    lists, ModelOutputs, dataclasses, deeper tuples) are opened instead, one line per tensor
    inside, named by its path (``output[loss]``, ``output[1][0][2]``).
    """
    found = None
    if native.frame_entries is not None and type(module).named_parameters is _named_parameters:
        found = native.frame_entries(module._parameters, input, output, kwargs or None, bool(containers))
    entries, tensors, dtypes = found or entries_of(forward_items(module, input, output, kwargs, containers))
    return new_frame(module_name, class_name(module), entries, dtypes), tensors


def forward_items(module, input, output, kwargs=None, containers=False):
    """``(value, ctx)`` of one forward hook call, in the reference's order (see forward_frame)."""
    items = own_parameters(module)
    if isinstance(input, tuple):
        items.extend(zip(input, _INPUT_CTX if len(input) <= _CTX_CACHE else _ctx("input", len(input))))
    else:
        items.append((input, "input"))
    if kwargs:
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) or (containers and _holds_tensors(value)):
                items.append((value, f"input[{name}]"))
    if isinstance(output, tuple):
        for i, x in enumerate(output):
            if isinstance(x, tuple):
                items.extend((y, f"output[{i}][{j}]") for j, y in enumerate(x))
            else:
                items.append((x, _OUTPUT_CTX[i] if i < _CTX_CACHE else f"output[{i}]"))
    else:
        items.append((output, "output"))
    if containers:
        items = [leaf for var, ctx in items for leaf in _open(var, ctx)]
    return items


_MAX_DEPTH = 8


def _children(value):
    """``(key, child)`` of a container, or None for anything else (tensors, scalars, objects)."""
    if isinstance(value, torch.Tensor) or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, dict):  # ModelOutput is an OrderedDict of its set fields
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    return None


def _holds_tensors(value, depth=0):
    if isinstance(value, torch.Tensor):
        return True
    children = _children(value) if depth < _MAX_DEPTH else None
    return bool(children) and any(_holds_tensors(child, depth + 1) for _, child in children)


def _open(value, ctx, depth=0):
    """The ``(tensor, path)`` leaves of a container that holds tensors; other values as they are."""
    if depth == 0 and not _holds_tensors(value):
        return [(value, ctx)]
    children = _children(value) if depth < _MAX_DEPTH else None
    if children is None:
        return [(value, ctx)] if isinstance(value, torch.Tensor) else []
    return [leaf for key, child in children for leaf in _open(child, f"{ctx}[{key}]", depth + 1)]


def frame_of(module_name, class_name, items, phase=FORWARD):
    """A frame of ``(value, ctx)`` items, and the tensors among them that the engine reads."""
    entries, tensors, dtypes = entries_of(items)
    return Frame(module_name, class_name, entries, dtypes, phase), tensors


def entries_of(items):
    """The entries of ``(value, ctx)`` items, the tensors among them that the engine reads and
    their dtypes."""
    entries = []
    tensors = []
    dtypes = []
    for var, ctx in items:
        if isinstance(var, _Tensor):
            # the common case first, without a call: a plain strided tensor of a supported dtype
            dtype = var.dtype
            if (type(var) in PLAIN_TYPES and dtype in SUPPORTED_DTYPES and var.layout is _STRIDED
                    and not var.is_meta and not var.is_nested):
                entries.append((TENSOR, ctx, len(tensors)))
                tensors.append(var)
                dtypes.append(dtype)
                continue
            reason = unreadable_reason(var)
            if reason is None:
                entries.append((TENSOR, ctx, len(tensors)))
                tensors.append(var)
                dtypes.append(dtype)
            else:
                entries.append((UNREADABLE, ctx, reason))
        elif var is None:
            entries.append((NONE, ctx, None))
        else:
            entries.append((NOT_A_TENSOR, ctx, None))
    return entries, tensors, dtypes


# A hook's frame and call, made in C with the extension (Frame's __init__ and namedtuple's __new__
# cost ~0.4 us each, a tenth of a hook) and equal to what the Python code above makes.
new_frame, make_call = Frame, _python_call
if native.frame_setup is not None:
    native.frame_setup(Frame, Call, FORWARD, _CLASS_NAMES, class_name, _named_parameters)
    new_frame, make_call = native.make_frame, native.make_call
