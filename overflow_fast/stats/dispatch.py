"""Backend selection for ``tensor_stats``: explicit name, ``OVERFLOW_FAST_BACKEND``, or the fastest
available backend for each device. Compiled backends load lazily; a missing or broken one warns
once and falls back to the torch backend, so ``import overflow_fast`` never fails because of it."""

import importlib
import os
import warnings

import torch

from .batch import StatsBatch
from .layout import INTEGER_DTYPES, NUM_COLUMNS, SMALLEST_NORMAL

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
_choices = {}  # requested backend -> {(device, dtype, layout): backend module}

SUPPORTED_DTYPES = frozenset(SMALLEST_NORMAL) | INTEGER_DTYPES | {torch.bool}


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
    return _loaded[name]


def backend_status():
    """``{name: None or reason it is unavailable}`` for every backend."""
    return {name: _load(name)[1] for name in BACKEND_NAMES}


def unreadable_reason(tensor: torch.Tensor):
    """Why the engine cannot read ``tensor``, or None when it can."""
    if tensor.layout != torch.strided:
        return f"{str(tensor.layout).replace('torch.', '')} layout is not supported"
    if tensor.is_meta:
        return "meta tensors hold no data"
    if tensor.is_quantized:
        return "quantized tensors are not supported"
    if tensor.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(tensor.dtype).replace('torch.', '')} is not supported"
    return None


def check_backend_name(backend):
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or one of {BACKEND_NAMES}, got {type(backend).__name__}")
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKEND_NAMES} or None")
    return backend


def _requested_backend(backend):
    if backend is not None:
        return check_backend_name(backend), f"backend={backend!r}"
    env = os.environ.get(ENV_VAR) or None
    if env is not None:
        if env not in BACKEND_NAMES:
            raise ValueError(f"{ENV_VAR}={env!r} is not one of {BACKEND_NAMES}")
        return env, f"{ENV_VAR}={env}"
    return None, None


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
        if reason is not None:
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


def _check_out(out, tensors):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if out.dtype != torch.int64 or tuple(out.shape) != (len(tensors), NUM_COLUMNS) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous int64 tensor of shape ({len(tensors)}, {NUM_COLUMNS}), "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and tensor.device != out.device:
            raise ValueError(f"out is on {out.device} but tensors[{index}] is on {tensor.device}")


def tensor_stats(tensors, backend=None, *, out=None) -> StatsBatch:
    """Statistics of every tensor in ``tensors`` (a list or tuple), kept on their devices.

    Per tensor: abs_min, abs_max (NaN if any element is NaN, None if empty), counts of nan,
    +inf, -inf, zero and subnormal elements, and numel. ``backend`` is None (the fastest
    available per device, or ``$OVERFLOW_FAST_BACKEND``), "torch", "cpu" or "triton".
    ``out``: a contiguous ``[len(tensors), 8]`` int64 tensor on the tensors' device to write the
    rows into (rows of a preallocated buffer), instead of a new one.
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"tensor_stats expects a list or tuple of tensors, got {type(tensors).__name__}"
            + (" (wrap a single tensor in a list)" if isinstance(tensors, torch.Tensor) else "")
        )
    if out is not None:
        _check_out(out, tensors)
    requested, origin = _requested_backend(backend)
    # Called once per module forward with a few tensors, so the choice of backend is cached per
    # (device, dtype, layout) (all that readability and supports() look at), and the common case,
    # one device and one backend, makes a single group without a dict.
    choices = _choices.setdefault(requested, {})
    first = None
    groups = None
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor_stats: tensors[{index}] is a {type(tensor).__name__}, not a tensor")
        key = (tensor.device, tensor.dtype, tensor.layout)
        module = choices.get(key)
        if module is None:
            module = choices[key] = _choose(index, tensor, requested, origin)
        group = (key[0], module)
        if first is None:
            first = group
        elif groups is None and group != first:
            groups = {first: list(range(index))}
        if groups is not None:
            groups.setdefault(group, []).append(index)
    dtypes = [t.dtype for t in tensors]
    if groups is None:
        if first is None:
            return StatsBatch(dtypes, [(range(0), out)] if out is not None else [])
        return StatsBatch(dtypes, [(range(len(tensors)), first[1].compute(tensors, out=out))])
    results = [(indices, module.compute([tensors[i] for i in indices])) for (_, module), indices in groups.items()]
    if out is None:
        return StatsBatch(dtypes, results)
    for indices, values in results:  # several backends on out's device: place their rows
        for row, index in enumerate(indices):
            out[index].copy_(values[row])
    return StatsBatch(dtypes, [(range(len(tensors)), out)])
