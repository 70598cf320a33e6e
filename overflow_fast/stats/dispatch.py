"""Backend selection for ``tensor_stats``: explicit name, ``OVERFLOW_FAST_BACKEND``, or the fastest
available backend for each device. Compiled backends load lazily; a missing or broken one warns
once and falls back to the torch backend, so ``import overflow_fast`` never fails because of it."""

import contextlib
import importlib
import os
import sys
import warnings
from typing import Optional, Sequence

import torch
from torch.compiler import is_compiling as _is_compiling

from . import kinds
from .batch import StatsBatch
from .kinds import PLAIN_TYPES, tensor_device, unreadable_reason
from .layout import ABS_MIN, NAN, NUM_COLUMNS, NUMEL, ZERO

BACKEND_NAMES = ("torch", "cpu", "triton")
ENV_VAR = "OVERFLOW_FAST_BACKEND"

_MODULES = {
    "torch": "overflow_fast.stats.torch_backend",
    "cpu": "overflow_fast.stats.cpu_backend",
    "triton": "overflow_fast.stats.triton_backend",
}
# Preferred backend per device type when none is named; the torch backend serves every device.
_PREFERRED = {"cpu": "cpu", "cuda": "triton"}

_loaded = {}
_warned = set()
_choices = {}  # requested backend -> {(device, dtype): backend module} of plain strided tensors
_STRIDED = torch.strided
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _load(name):
    """The backend module and the reason it cannot run (None when it can)."""
    if name not in _loaded:
        try:
            module = importlib.import_module(_MODULES[name])
            reason = module.unavailable_reason()
        except Exception as error:  # a broken optional backend must not break the engine
            module, reason = None, f"{type(error).__name__}: {error}"
        _loaded[name] = (module, reason)
        _choices.clear()
        _READERS.clear()
    return _loaded[name]


def forget_choices():
    """Forget what was decided (the backends loaded and their availability, each device's backend
    and read): the next call decides again, as in a fresh process. For a test or a benchmark that
    changes what a backend supports; the package never calls it."""
    _loaded.clear()
    _choices.clear()
    _READERS.clear()


@contextlib.contextmanager
def preferring(device_type, name):
    """Within it, ``device_type``'s tensors go to backend ``name`` where none is requested (a test or
    benchmark standing CPU tensors in for a GPU's); what was decided is forgotten on the way in and
    on the way out."""
    before = _PREFERRED.get(device_type)
    _PREFERRED[device_type] = name
    forget_choices()
    try:
        yield
    finally:
        if before is None:
            del _PREFERRED[device_type]
        else:
            _PREFERRED[device_type] = before
        forget_choices()


def backend_status():
    """``{name: None or reason it is unavailable}`` for every backend."""
    return {name: _load(name)[1] for name in BACKEND_NAMES}


def check_backend_name(backend):
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or one of {BACKEND_NAMES}, got {type(backend).__name__}")
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKEND_NAMES} or None")
    return backend


def requested_backend(backend):
    """The backend asked for (None: the default per device) and where the request came from.

    ``backend=`` is a demand: an unavailable one is an error at the call. The environment
    variable is a preference for the whole process: an unavailable one warns once and gives way
    to the default choice.
    """
    if backend is not None:
        return check_backend_name(backend), f"backend={backend!r}"
    env = os.environ.get(ENV_VAR) or None
    if env is not None:
        if env not in BACKEND_NAMES:
            raise ValueError(f"{ENV_VAR}={env!r} is not one of {BACKEND_NAMES}")
        reason = _load(env)[1]
        if reason is not None:
            _warn_once(("env", env), f"overflow_fast: {ENV_VAR}={env} is unavailable ({reason}); "
                       "using the default backend of each device")
            return None, None
        return env, f"{ENV_VAR}={env}"
    return None, None


def _never():
    return False


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _module_for(tensor, requested, origin):
    """The backend module that computes ``tensor``'s statistics. Backends' ``supports()`` may
    look only at the device, dtype and layout (the choice is cached on them)."""
    if requested is not None:
        module, reason = _load(requested)
        if reason is not None:
            raise RuntimeError(f"overflow_fast: {origin} is unavailable: {reason}")
        if not module.supports(tensor):
            raise ValueError(
                f"overflow_fast: {origin} cannot read a {tensor.dtype} tensor on {tensor.device}"
            )
        return module
    preferred = _PREFERRED.get(tensor.device.type)
    if preferred is not None:
        module, reason = _load(preferred)
        if reason is None and module.supports(tensor):
            return module
        if reason is not None and not getattr(module, "warned", _never)():  # the cpu backend warns as it loads
            _warn_once(
                preferred,
                f"overflow_fast: the {preferred!r} backend is unavailable ({reason}); "
                "falling back to the slower 'torch' backend",
            )
    return _load("torch")[0]


def _choose(index, tensor, requested, origin):
    """The backend module for ``tensors[index]``, after checking that the engine can read it."""
    reason = unreadable_reason(tensor)
    if reason is not None:
        raise TypeError(f"tensor_stats: tensors[{index}] cannot be read: {reason}")
    return _module_for(tensor, requested, origin)


def _byte_extent(tensor):
    """[first, last) bytes that a strided tensor's elements may occupy."""
    start = tensor.data_ptr()
    low = high = 0
    for size, stride in zip(tensor.shape, tensor.stride()):
        reach = (size - 1) * stride
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return start + low * tensor.element_size(), start + (high + 1) * tensor.element_size()


def _check_out_shape(out, count):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if (type(out) not in PLAIN_TYPES or out.dtype != torch.int64 or out.layout != torch.strided
            or tuple(out.shape) != (count, NUM_COLUMNS) or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous int64 tensor of shape ({count}, {NUM_COLUMNS}), "
            f"got {type(out).__name__} {out.dtype} {tuple(out.shape)}"
        )


def _storage_bytes(out):
    """[first, last) bytes of ``out``'s allocation."""
    storage = out.untyped_storage()
    first = storage.data_ptr()
    return first, first + storage.nbytes()


def _check_overlap(out, index, tensor):
    """Raise if ``tensor`` (plain, strided, non-empty, starting inside ``out``'s allocation) shares
    memory with ``out``."""
    out_first, out_last = _byte_extent(out)
    first, last = _byte_extent(tensor)
    if first < out_last and out_first < last:
        raise ValueError(f"out overlaps the memory of tensors[{index}]; its rows would overwrite it")


def _check_out(out, tensors):
    _check_out_shape(out, len(tensors))
    # Rows are zeroed or written before every input is read: out must not share their memory.
    # Only a tensor starting inside out's allocation can share it (allocations never overlap),
    # so the exact extents are computed for those alone (this runs at every call given ``out``).
    storage_first, storage_last = _storage_bytes(out)
    device = out.device
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.device != device:
            raise ValueError(f"out is on {device} but tensors[{index}] is on {tensor.device}")
        if (type(tensor) in PLAIN_TYPES and tensor.layout is _STRIDED and not tensor.is_meta
                and storage_first <= tensor.data_ptr() < storage_last and tensor.numel()):
            _check_overlap(out, index, tensor)


_SCAN = object()  # key in _choices[requested]: (device, _SCAN) -> (module, words) or None


def _scan_plan(device, requested):
    """(backend module, {dtype: format word}) when the backend chosen for ``device`` builds its
    table of plain tensors in one C++ loop (the triton backend with the extension loaded), or
    (the cpu backend, {dtype: None}) when it is the C++ kernel, whose own checks refuse what it
    cannot read: the dtypes are those it would be chosen for, as ``_module_for`` decides. Else
    None."""
    name = requested if requested is not None else _PREFERRED.get(device.type)
    if name == "cpu" and device.type == "cpu":
        module, reason = _load(name)
        if reason is not None:
            return None
        with warnings.catch_warnings():  # an empty complex32 probe warns that the dtype is experimental
            warnings.simplefilter("ignore")
            words = {dtype: None for dtype in kinds.SUPPORTED_DTYPES if module.supports(torch.empty(0, dtype=dtype))}
        return (module, words) if words else None
    if name != "triton":
        return None
    module, reason = _load(name)
    if reason is not None:
        return None
    words = {dtype: word for dtype, word in module.table_words(device).items() if dtype in kinds.SUPPORTED_DTYPES}
    return (module, words) if words else None


def _plain_stats(tensors, requested, out):
    """``tensor_stats`` of a list of plain strided tensors on one device whose backend builds its
    table in C++ (``_scan_plan``): one C++ loop checks every tensor and writes the table, where the
    general path spends a few microseconds of Python per tensor. None when the call is not that
    case (nothing launched; the general path then runs, and raises what it raises)."""
    first = tensors[0]
    if type(first) not in PLAIN_TYPES:
        return None
    device = first.device
    choices = _choices.setdefault(requested, {})
    key = (device, _SCAN)
    if key not in choices:
        choices[key] = _scan_plan(device, requested)
    plan = choices[key]
    if plan is None:
        return None
    module, words = plan
    zero3 = "deepspeed" in sys.modules  # a released ZeRO-3 parameter is a plain, empty tensor
    if module.NAME == "cpu":
        return _plain_cpu_stats(module, words, tensors, out, zero3)
    out_storage = None
    if out is not None:
        _check_out_shape(out, len(tensors))  # the kernels write into it unchecked
        if out.device != device:
            return None
        out_storage = _storage_bytes(out)
    if len(tensors) <= module.MAX_SLOTS * module.MAX_READ_LAUNCHES:  # one launch per 8, nothing uploaded
        rows = out if out is not None else torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=device)
        if module.read_into(tensors if type(tensors) is list else list(tensors), rows):
            return StatsBatch([t.dtype for t in tensors], [(range(len(tensors)), rows)])
    scanned = module.scan(tensors if type(tensors) is list else list(tensors), words,
                          module.BLOCK_SIZE * module.BLOCKS_PER_CHUNK, out_storage, zero3)
    if scanned is None:
        return None
    for index in scanned.overlaps:
        _check_overlap(out, index, tensors[index])
    if zero3 and any(kinds.is_zero3_released(tensors[index]) for index in scanned.empties):
        return None
    return StatsBatch(scanned.dtypes, [(range(len(tensors)), module.compute_scanned(scanned, out))])


_READERS = {}  # (requested backend, device) -> that device's read into rows, or None


def rows_launcher(backend, device):
    """The C++ launcher that writes the rows of a few tensors on ``device`` into a preallocated
    buffer for ``backend`` (as ``tensor_stats`` takes it), called from C++ by whoever binds it:
    the triton backend's list kernel, or on the CPU the C++ kernel; None where neither applies
    (the torch backend, no extension, a device whose self-check failed)."""
    device = tensor_device(device)
    requested, _ = requested_backend(backend)
    name = requested if requested is not None else _PREFERRED.get(device.type)
    if name not in ("triton", "cpu") or (name == "cpu" and device.type != "cpu"):
        return None
    module, reason = _load(name)
    if reason is not None:
        return None
    if name == "cpu":
        return module.launcher()
    if not module.supports(torch.empty(0, device=device)):
        return None
    return module.launcher(device)


def rows_reader(backend, device):
    """The backend's read of a few tensors on ``device`` into preallocated rows, when ``backend``
    (as ``tensor_stats`` takes it) means the triton backend there: ``read_into(tensors, out)``,
    True when it wrote the rows, False when the caller must take ``tensor_stats``. Else None."""
    device = tensor_device(device)
    requested, _ = requested_backend(backend)
    key = (requested, device)
    if key not in _READERS:
        name = requested if requested is not None else _PREFERRED.get(device.type)
        reader = None
        if name == "triton":
            module, reason = _load(name)
            if reason is None and module.supports(torch.empty(0, device=device)):
                reader = module.read_into
        _READERS[key] = reader
    return _READERS[key]


def _plain_cpu_stats(module, dtypes, tensors, out, zero3):
    """``_plain_stats`` on the CPU: one call to the C++ kernel, which checks every tensor itself
    (a plain strided CPU tensor of its dtypes, memory it owns, ``out`` apart from them) before it
    writes anything. For a call's few tensors the general path costs more than the kernel's
    whole call. None when a tensor is not such a tensor: the general path then runs."""
    if out is not None and type(out) not in PLAIN_TYPES:
        return None  # the general path says why
    seen = []
    for tensor in tensors:
        if type(tensor) not in PLAIN_TYPES:
            return None
        dtype = tensor.dtype
        if dtype not in dtypes or (zero3 and kinds.is_zero3_released(tensor)):
            return None
        seen.append(dtype)
    try:
        values = module.compute(tensors, out)
    except RuntimeError:  # refused (a sparse, nested, wrapped or meta tensor; out overlapping)
        return None
    return StatsBatch(seen, [(range(len(seen)), values)])


class _ThroughOps:
    """Rows of ``__torch_dispatch__`` subclasses, computed with torch ops on the subclass itself
    (they reach whatever values it exposes), then brought back as a plain tensor: one host read
    per tensor, for tensors the kernels must never touch."""

    NAME = "ops"

    @staticmethod
    def compute(tensors, out=None):
        torch_backend = _load("torch")[0]
        rows = []
        for tensor in tensors:
            try:
                rows.append(_host_row(torch_backend.compute([tensor]).reshape(-1)))
            except Exception as error:
                raise TypeError(f"tensor_stats: a {type(tensor).__name__} cannot be read through torch ops: "
                                f"{kinds.short_reason(f'{type(error).__name__}: {error}')}") from error
        device = tensors[0].device
        values = torch.tensor(rows, dtype=torch.int64).to(device)
        if out is None:
            return values
        return out.copy_(values)


def _host_row(row):
    """A row computed on a subclass may itself be one (its ops return wrappers again)."""
    try:
        return [int(v) for v in row.tolist()]
    except Exception:
        return [int(row[i].item()) for i in range(row.numel())]


def tensor_stats(tensors: Sequence[torch.Tensor], backend: Optional[str] = None, *,
                 out: Optional[torch.Tensor] = None) -> StatsBatch:
    """Statistics of every tensor in ``tensors`` (a list or tuple), kept on their devices.

    Per tensor: abs_min, abs_max (NaN if any element is NaN, None if empty), counts of nan,
    +inf, -inf, zero and subnormal elements, and numel. ``backend`` is None (the fastest
    available per device, or ``$OVERFLOW_FAST_BACKEND``), "torch", "cpu" or "triton".
    ``out``: a contiguous ``[len(tensors), 8]`` int64 tensor on the tensors' device to write the
    rows into (rows of a preallocated buffer), instead of a new one; it must not overlap them.

    Tensors that are not plain storage-backed tensors are read through what they really hold
    (see ``kinds``); those the engine cannot read raise TypeError.
    """
    if _is_compiling():  # torch.compile tracing this call (about 0.1 us when not)
        traced = _traced_tensor_stats(tensors, backend, out)
        if traced is not None:
            return traced
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"tensor_stats expects a list or tuple of tensors, got {type(tensors).__name__}"
            + (" (wrap a single tensor in a list)" if isinstance(tensors, torch.Tensor) else "")
        )
    requested, origin = requested_backend(backend)
    if tensors:  # the common call: plain tensors on one device, checked in one C++ loop
        batch = _plain_stats(tensors, requested, out)
        if batch is not None:
            return batch
    if out is not None:
        _check_out(out, tensors)
    targets, sparse, first, groups = _grouped(tensors, requested, origin)
    dtypes = [t.dtype for t in tensors]
    if groups is None:
        if first is None:
            return StatsBatch(dtypes, [(range(0), out)] if out is not None else [])
        batch = StatsBatch(dtypes, [(range(len(tensors)), first[1].compute(targets, out=out))])
    else:
        results = [(indices, module.compute([targets[i] for i in indices])) for (_, module), indices in groups.items()]
        if out is None:
            batch = StatsBatch(dtypes, results)
        else:
            for indices, values in results:  # several backends on out's device: place their rows
                for row, index in enumerate(indices):
                    out[index].copy_(values[row])
            batch = StatsBatch(dtypes, [(range(len(tensors)), out)])
    if sparse:
        for index, dense_numel in sparse.items():
            _count_implicit_zeros(batch.row(index), dense_numel - targets[index].numel(), dense_numel)
    return batch


def _grouped(tensors, requested, origin):
    """``tensor_stats``' tensors by (device, backend): ``(targets, sparse, first, groups)``, the
    tensors each backend reads (what a non-plain one really holds), the rows that must count
    implicit zeros (index -> dense numel), the first group, and every group's indices where there
    is more than one (else None)."""
    # Called once per module forward with a few tensors, so the choice of backend is cached per
    # (device, dtype) of plain strided tensors (all that readability and supports() look at),
    # and the common case, one device and one backend, makes a single group without a dict.
    choices = _choices.setdefault(requested, {})
    first = None
    groups = None
    targets = tensors
    sparse = None  # index -> dense numel, for rows that must count implicit zeros
    zero3 = "deepspeed" in sys.modules  # a released ZeRO-3 parameter is a plain, empty tensor
    for index, tensor in enumerate(tensors):
        if (type(tensor) in PLAIN_TYPES and tensor.layout is _STRIDED and not tensor.is_nested
                and not _is_functorch_wrapped(tensor) and not (zero3 and kinds.is_zero3_released(tensor))):
            key = (tensor.device, tensor.dtype)
            module = choices.get(key)
            if module is None:
                module = choices[key] = _choose(index, tensor, requested, origin)
        else:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor_stats: tensors[{index}] is a {type(tensor).__name__}, not a tensor")
            plan = kinds.plan(tensor)
            if isinstance(plan, str):
                raise TypeError(f"tensor_stats: tensors[{index}] cannot be read: {plan}")
            if targets is tensors:
                targets = list(tensors)
            targets[index] = plan.target
            if plan.dense_numel is not None:
                sparse = sparse or {}
                sparse[index] = plan.dense_numel
            if plan.route == kinds.OPS:
                module = _ThroughOps
            else:
                module = _choose(index, plan.target, requested, origin)
            key = (plan.target.device, None)
        group = (key[0], module)
        if first is None:
            first = group
        elif groups is None and group != first:
            groups = {first: list(range(index))}
        if groups is not None:
            groups.setdefault(group, []).append(index)
    return targets, sparse, first, groups


def _traced_tensor_stats(tensors, backend, out):
    """While torch.compile traces ``tensor_stats``: the rows of plain strided tensors on one
    device, through the engine's torch ops (ops.py: one node in the graph, no graph break), or
    None for what they do not take (the eager path below then runs under the tracer). The same
    rows as eagerly; the checks that need data pointers (``out`` overlapping an input) are the
    kernel's at run time."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    device = tensors[0].device
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or type(tensor) not in PLAIN_TYPES or \
                tensor.layout != torch.strided or tensor.device != device:
            return None
    name = _PREFERRED.get(device.type)
    requested = backend if backend is not None else (os.environ.get(ENV_VAR) or None)
    if out is not None and (out.dtype != torch.int64 or out.device != device
                            or tuple(out.shape) != (len(tensors), NUM_COLUMNS)):
        return None  # the eager path raises its error
    from . import ops

    if name is not None and requested in (None, name) and ops.traceable(name, tensors):
        rows = ops.compute(tensors, out)
    elif requested is None or requested == "torch":
        # the default's op is not here (no C++ extension, no Triton), or the torch backend asked for:
        # the torch backend's device ops, which trace as they are (the same rows; no graph break).
        # A backend named explicitly takes the eager path, which says why it cannot run.
        from . import torch_backend

        if not all(torch_backend.traces(t.dtype) for t in tensors):
            return None
        rows = torch_backend.traced_rows(tensors, out)
    else:
        return None
    return StatsBatch([t.dtype for t in tensors], [(range(len(tensors)), rows)])


def _count_implicit_zeros(row, implicit, dense_numel):
    """A sparse tensor's row, computed from its stored values, made the dense tensor's row (on the
    device, no sync): the unstored elements are zeros."""
    if implicit <= 0:
        return
    row[ZERO] += implicit
    row[NUMEL] = dense_numel
    # the smallest magnitude is now 0 (bits 0 for float 0.0 and integer 0), unless a NaN poisons it
    row[ABS_MIN] = row[ABS_MIN] * (row[NAN] > 0)
