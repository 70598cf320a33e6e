"""The hook layer's C++ (``overflow_fast._C.hooks``: csrc/hook_layer.h and hooks.cpp),
opened here alone (``native``), and its Python twins, for where the extension cannot be loaded:
``HookCore`` (the detector's bookkeeping of when each hook's tensors are read), ``OutputGradients``
(the gradients arriving at forward outputs), ``EntriesOf`` (a hook call's entries: frames.py's),
``culprit.KeptCall``, and ``forward_call``: a forward hook's work with all of them in one call. The
factories below give the C++ one where it loads, else the twin.

One specification, two implementations: the same methods, arguments and results, call for call
(tests/test_hook_core.py runs both on the same sequences of calls). For HookCore, csrc/hooks.cpp
describes the rules; in short, a tensor seen again in a pass unchanged (the same tensor, version counter and data
pointer) keeps its row, and with deferral a call site's tensors wait until the pass ends once a
pass showed them unchanged at its end. What C++ reads off the TensorImpl is read here through
Python with subclasses' ``__torch_function__`` off, as the C++ side never sees it.
"""

import functools
import weakref

import torch

from ..stats import unreadable_reason
from ..stats.kinds import PLAIN_TYPES, SUPPORTED_DTYPES
from ..replay.culprit import KeptCall
from .frames import (container_leaves, entries_of, forward_items, opens_nothing, own_parameters,
                     parameters_listed_as_torch)
from .text import TENSOR

HOOK_FULL = -1  # not enough free rows: read what is pending, then add again
HOOK_MIXED_DEVICES = -2  # the tensors are on several devices: read them apart

# Who read the tensors an answer hands out (its last element; csrc/hooks.cpp's Read): the caller
# (no launcher bound, or it declined them; always so here), the bound launcher, or nobody: the
# launcher failed on them (its ``disabled`` says why, once; it declines from then on).
READ_BY_CALLER, LAUNCHED, LAUNCH_FAILED = 0, 1, 2


def native():
    """The hook layer's C++ module, or None where the extension cannot be loaded. It is built into
    the one library the engine's kernels are built into, as a submodule of its own that only this
    module opens; it reaches the engine through the launcher it is bound to (``HookCore.bind``)."""
    from ..stats.cpu_backend import extension

    module = extension()
    return None if module is None else module.hooks


def new_core(capacity, stage_bytes, max_remembered):
    """The hook layer's bookkeeping: the C++ ``HookCore`` where the extension loads, else this
    module's twin (the same answers)."""
    module = native()
    return (module.HookCore if module is not None else HookCore)(capacity, stage_bytes, max_remembered)


def output_gradients(callback, hook_apart):
    """The gradients arriving at forward outputs: the extension's ``OutputGradients`` where it loads,
    else this module's twin (the same hooks, owners and answers)."""
    module = native()
    return (module.OutputGradients if module is not None else OutputGradients)(callback, hook_apart)


class OutputGradients:
    """The twin of csrc/hooks.cpp's ``OutputGradients`` (whose comment says the rules): ``watch``
    hooks the gradients of a forward call's output tensors that require one, and notes the module
    as a consumer of the hooked tensors it took as inputs; ``clear`` turns every hook into a no-op.
    A hook holds this object weakly and its owner, whose modules are weak references: one that
    outlives the detector (on a loss kept after ``remove()``) keeps nothing of it alive."""

    __slots__ = ("_callback", "_hook_apart", "_owners", "_incoming", "__weakref__")

    def __init__(self, callback, hook_apart):
        self._callback = callback
        self._hook_apart = hook_apart
        self._owners = {}  # id(output tensor) -> (weakref, owner)
        self._incoming = set()  # ids of the modules whose outputs' gradients are hooked

    def watch(self, module, entries, tensors):
        if not torch.is_grad_enabled() or self._callback is None:
            return
        if len(self._owners) > 1 << 16:  # submodules driven alone never start a new forward
            self.new_forward()
        for kind, ctx, payload in entries:
            if kind != TENSOR:
                continue
            tensor = tensors[payload]
            is_input = ctx.startswith("input")
            if not is_input and not (ctx.startswith("output") and tensor.requires_grad):
                continue  # a parameter, or an output without a gradient
            known = self._owners.get(id(tensor))
            if known is not None and known[0]() is not tensor:
                known = None
            if is_input:
                consumer = weakref.ref(module)
                if known is not None and consumer not in known[1][2]:
                    known[1][2].append(consumer)
                continue
            self._incoming.add(id(module))
            if known is not None:
                known[1][:2] = [weakref.ref(module), f"{ctx}.grad"]  # hooks run inner first: the outer one wins
                continue
            owner = [weakref.ref(module), f"{ctx}.grad", [], id(tensor)]
            hook = functools.partial(_gradient_hook, weakref.ref(self), owner)
            if type(tensor) in PLAIN_TYPES:
                tensor.register_hook(hook)
            else:
                self._hook_apart(tensor, hook)
            self._owners[id(tensor)] = (weakref.ref(tensor), owner)

    def new_forward(self):
        self._owners.clear()
        self._incoming.clear()

    def incoming_read(self, module):
        return id(module) in self._incoming

    def clear(self):
        self._callback = None
        self._hook_apart = None
        self.new_forward()


def _gradient_hook(outputs, owner, grad):
    outputs = outputs()
    callback = outputs._callback if outputs is not None else None
    if callback is not None:
        callback(owner, grad)
    # returns None: the gradient flows on unchanged


def entries_reader(containers):
    """The entries of hook calls outside torch.func transforms (``of(items)``, ``forward(module, input,
    output, kwargs)``): the extension's one-pass ``EntriesOf`` where it loads, else frames.py's own
    (``EntriesOf`` below); the same answers."""
    module = native()
    if module is None:
        return EntriesOf(containers)
    return module.EntriesOf(SUPPORTED_DTYPES, unreadable_reason, own_parameters, parameters_listed_as_torch,
                            container_leaves, opens_nothing, containers)


def forward_call_function():
    """``forward_call``: the extension's one crossing where it loads, else this module's twin."""
    module = native()
    return forward_call if module is None else module.forward_call


def forward_call(entries_of, module, input, output, kwargs, outputs, kept, core, site, waits_on_cpu):
    """One forward hook call outside torch.func transforms (csrc/hooks.cpp's ``forward_call`` in one
    crossing; this is its specification): its entries, the hooks on its outputs' gradients
    (``outputs``: an ``OutputGradients`` or None), its kept call's output (``kept``: a KeptCall or
    None) and its rows (``core``'s ``add``; None: the caller adds them). ``site`` >= 0: the call may
    wait, where its tensors are off the CPU or ``waits_on_cpu``. ``(entries, tensors, dtypes, sources,
    answer)``: the call's sources ``(key, rows, None)`` where the add's answer is ``settled``, else None
    and that answer (None where nothing was added)."""
    entries, tensors, dtypes = entries_of.forward(module, input, output, kwargs)
    if outputs is not None:
        outputs.watch(module, entries, tensors)
    if kept is not None:
        kept.returned(output)
    added = None
    if core is not None and tensors:
        if site >= 0 and not waits_on_cpu and tensors[0].is_cpu:
            site = -1
        added = core.add(tensors, site, site >= 0)
        if settled(added):
            return entries, tensors, dtypes, (added[0], added[1], None), None
    return entries, tensors, dtypes, None, added


def settled(answer):
    """Whether ``HookCore.add``'s answer leaves its caller nothing to do: added, no row changed
    after its hook, and its rows read by the launcher or waiting."""
    key, _, _, to_read, changed, read = answer
    return key >= 0 and not changed and (read == LAUNCHED or not to_read)


def kept_call_class():
    """find_op's record of a hooked call: the extension's ``KeptCall`` where it loads (its C++
    construction, fields and methods), else ``culprit.KeptCall``, its specification (the same
    fields by the same rules, and the same methods)."""
    module = native()
    return KeptCall if module is None else module.KeptCall


class EntriesOf:
    """The twin of csrc/hooks.cpp's ``EntriesOf``: frames.py's ``entries_of`` and ``forward_items``."""

    def __init__(self, containers):
        self.containers = containers

    def of(self, items):
        return entries_of(items)

    def forward(self, module, input, output, kwargs):
        return entries_of(forward_items(module, input, output, kwargs, self.containers))


# per call site and tensor position, under deferral (as in csrc/hooks.cpp)
_UNKNOWN, _DEFER, _AT_ONCE = 0, 1, 2

_STRIDED = torch.strided
_PYTHON_KEY = torch._C.DispatchKey.Python
_dispatch_keys = torch._C._dispatch_keys
_no_subclass = torch._C.DisableTorchFunctionSubclass


def _version_of(tensor):
    """The version counter, or -1 where there is none (inference tensors)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _data_of(tensor):
    """Where the storage starts, or None where the tensor has no storage of its own (wrapper
    subclasses, sparse and functorch-wrapped tensors): those are told apart by version alone."""
    if tensor.layout != _STRIDED or _dispatch_keys(tensor).has(_PYTHON_KEY):
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _facts(tensor):
    """(version, data pointer, bytes, requires_grad) of a tensor, as the C++ core reads them."""
    return _version_of(tensor), _data_of(tensor), tensor.numel() * tensor.element_size(), tensor.requires_grad


def _plain(tensors):
    for tensor in tensors:
        if type(tensor) not in PLAIN_TYPES:
            return False
    return True


class _Held:
    """A tensor whose read waits, or a call site's tensor watched until the pass ends."""

    __slots__ = ("tensor", "version", "data", "site", "position")

    def __init__(self, tensor, version, data, site, position):
        self.tensor = tensor
        self.version = version
        self.data = data
        self.site = site
        self.position = position

    def changed(self):
        tensor = self.tensor
        if type(tensor) in PLAIN_TYPES:
            return _version_of(tensor) != self.version or _data_of(tensor) != self.data
        with _no_subclass():
            return _version_of(tensor) != self.version or _data_of(tensor) != self.data


class _DeviceRows:
    __slots__ = ("device", "used", "launched", "deferred", "deferred_bytes")

    def __init__(self, device):
        self.device = device
        self.used = 0  # rows given out since the last reset
        self.launched = 0  # rows [0, launched) were handed to the caller to read
        self.deferred = []  # the _Held of rows [launched, used)
        self.deferred_bytes = 0  # of those, the ones only deferral keeps alive


class HookCore:
    """The detector's bookkeeping of when each hook's tensors are read (csrc/hooks.cpp's twin)."""

    def __init__(self, capacity, stage_bytes, max_remembered):
        if capacity <= 0:
            raise RuntimeError(f"HookCore: capacity must be positive, got {capacity}")
        if stage_bytes < 0:
            raise RuntimeError(f"HookCore: stage_bytes must be >= 0, got {stage_bytes}")
        self._capacity = int(capacity)
        self._stage_bytes = int(stage_bytes)
        self._max_remembered = int(max_remembered)
        self._devices = []
        # its TensorImpl's address (tensor._cdata, as the C++ core keys it: a dead tensor's entry
        # is replaced, and counts toward max_remembered, exactly as there) -> (weak reference,
        # version, data, device key, row); the weak reference tells a dead tensor from a new one at
        # the same address, as the C++ side's weak pointer does
        self._seen = {}
        self._forgot = False  # _seen was cleared in this pass (past max_remembered)
        self._modes = {}  # call site -> [mode per tensor position]
        self._watched = []
        self._watched_bytes = 0

    def add(self, tensors, site, defer):
        """``(device key, rows, first, to_read, changed, read)``; not added: ``(HOOK_FULL or
        HOOK_MIXED_DEVICES, None, None, None, None, None)``. See csrc/hooks.cpp."""
        tensors = list(tensors)
        if not tensors:
            raise RuntimeError("HookCore.add: no tensors")
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"HookCore.add: expected tensors, got {type(tensor).__name__}")
        if _plain(tensors):
            return self._add(tensors, site, defer)
        with _no_subclass():
            return self._add(tensors, site, defer)

    def _add(self, tensors, site, defer):
        device = tensors[0].device
        for tensor in tensors:
            if tensor.device != device:
                return (HOOK_MIXED_DEVICES, None, None, None, None, None)
        key = self._device_key(device)
        rows = self._devices[key]
        count = len(tensors)
        if rows.used + count > self._capacity:
            return (HOOK_FULL, None, None, None, None, None)
        seen = self._seen
        if len(seen) + count > self._max_remembered:
            seen.clear()
            self._forgot = True
        may_defer = defer and site >= 0
        modes = None
        if may_defer:
            modes = self._modes.setdefault(site, [])
            if len(modes) < count:
                modes.extend([_UNKNOWN] * (count - len(modes)))
        read_now = not may_defer
        held_site = site if may_defer else -1
        remember = self._max_remembered > 0
        row_of = []
        for position, tensor in enumerate(tensors):
            version, data, size, requires_grad = _facts(tensor)
            mode = modes[position] if modes is not None and version >= 0 else _AT_ONCE
            if version >= 0:
                found = seen.get(tensor._cdata)
                if (found is not None and found[1] == version and found[2] == data and found[3] == key
                        and found[0]() is tensor):
                    row = found[4]
                    row_of.append(row)
                    # a row still waiting is read now where this position may not wait
                    read_now = read_now or (row >= rows.launched and mode != _DEFER)
                    if mode == _UNKNOWN and modes is not None:
                        self._watch(tensor, version, data, size, requires_grad, site, position)
                    continue
            row = rows.used
            rows.used += 1
            row_of.append(row)
            rows.deferred.append(_Held(tensor, version, data, held_site, position))
            if not requires_grad:  # autograd keeps the others until backward anyway
                rows.deferred_bytes += size
            if version >= 0 and remember:
                try:
                    seen[tensor._cdata] = (weakref.ref(tensor), version, data, key, row)
                except TypeError:  # a type without weak references: never reused
                    seen.pop(tensor._cdata, None)
            if mode != _DEFER:
                read_now = True
                if mode == _UNKNOWN and modes is not None:
                    self._watch(tensor, version, data, size, requires_grad, site, position)
        if rows.deferred_bytes + self._watched_bytes > self._stage_bytes:
            read_now = True
        if self._watched_bytes > self._stage_bytes:
            self._learn()
        first, to_read, changed = self._take(rows) if read_now else (rows.launched, [], [])
        return key, tuple(row_of), first, to_read, changed, READ_BY_CALLER

    def pending(self):
        """Every row still waiting: ``[(device key, first, to_read, changed, read)]``, as ``add`` gives them."""
        out = []
        for key, rows in enumerate(self._devices):
            if rows.launched < rows.used:
                out.append((key, *self._take(rows), READ_BY_CALLER))
        return out

    def reset(self):
        """Every row is free again and no tensor is reused or held; what the watched call sites
        did decides whether they may wait from now on."""
        self._learn()
        for rows in self._devices:
            rows.used = rows.launched = rows.deferred_bytes = 0
            rows.deferred = []
        self._seen.clear()
        self._forgot = False

    def bind(self, key, launcher, buffer):
        """The C++ core reads a device's tensors itself once a launcher is bound; there is no
        launcher without the extension, so this core's caller reads every tensor (READ_BY_CALLER)."""
        self._devices[key]  # noqa: B018 - the same IndexError as the C++ core's for an unknown key

    def used(self, key):
        """Rows in use on a device (by key)."""
        return self._devices[key].used

    def unchanged(self, tensor, key, row):
        """1 where ``tensor``, read into ``row`` of ``key``'s buffer in this pass, is unchanged since;
        0 where it changed; -1 where this core cannot tell. See csrc/hooks.cpp."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"HookCore.unchanged: expected a tensor, got {type(tensor).__name__}")
        found = self._seen.get(tensor._cdata)
        if found is None or found[0]() is not tensor:
            return -1
        if type(tensor) in PLAIN_TYPES:
            same = (_version_of(tensor), _data_of(tensor)) == found[1:3]
        else:
            with _no_subclass():
                same = (_version_of(tensor), _data_of(tensor)) == found[1:3]
        if found[3] == key and found[4] == row:
            return 1 if same else 0
        # read again since, into another row: it had changed then, unless this pass forgot that read
        return -1 if same and self._forgot else 0

    def device(self, key):
        """The device of a key."""
        return self._devices[key].device

    # -- internals --------------------------------------------------------------------------

    def _device_key(self, device):
        for key, rows in enumerate(self._devices):
            if rows.device == device:
                return key
        self._devices.append(_DeviceRows(device))
        return len(self._devices) - 1

    def _take(self, rows):
        """(first, tensors, changed rows) of a device's waiting rows, which count as launched from
        now. A deferred tensor changed since its hook is never handed out (its memory may be gone):
        an empty tensor stands in, and its call site is read at once from now on."""
        tensors = []
        changed = []
        row = rows.launched
        for held in rows.deferred:
            if held.site >= 0 and held.changed():
                changed.append(row)
                self._modes[held.site][held.position] = _AT_ONCE
                tensors.append(torch.empty(0, dtype=torch.uint8, device=held.tensor.device))
            else:
                tensors.append(held.tensor)
            row += 1
        first = rows.launched
        rows.launched = rows.used
        rows.deferred = []
        rows.deferred_bytes = 0
        return first, tensors, changed

    def _watch(self, tensor, version, data, size, requires_grad, site, position):
        """A call site's tensor read at once on its first sight: whether it changes before the pass
        ends decides whether that site may wait from then on."""
        self._watched.append(_Held(tensor, version, data, site, position))
        self._watched_bytes += 0 if requires_grad else size

    def _learn(self):
        for held in self._watched:
            modes = self._modes[held.site]
            if held.changed():
                modes[held.position] = _AT_ONCE
            elif modes[held.position] == _UNKNOWN:
                modes[held.position] = _DEFER
        self._watched = []
        self._watched_bytes = 0
