"""What a tensor really is, and what the kernels may read for it.

The kernels read raw memory, so they must only ever see plain, storage-backed strided tensors.
Everything else is decided here, by what the tensor is rather than by what it claims
(a wrapper subclass reports a device, a dtype and a strided layout, yet owns no memory):

- plain tensors and Parameters are read as they are;
- ``__torch_function__``-only subclasses own their memory: they are read as plain tensors;
- DTensor is read through its local shard (combining shards across ranks is the caller's);
- jagged and strided nested tensors through their values buffer;
- sparse tensors through their stored values, the implicit zeros added to the row afterwards;
- other ``__torch_dispatch__`` subclasses (a user's wrapper, torchao-style tensors) through torch
  ops, which reach the values the subclass exposes, as the reference's ``abs().min()`` does;
- fake, meta and functorch-transformed tensors hold no data the engine can read.
"""

import os
import sys

import torch

from .._compat import dtensor_api
from .layout import INTEGER_DTYPES, SMALLEST_NORMAL

SUPPORTED_DTYPES = frozenset(SMALLEST_NORMAL) | INTEGER_DTYPES | {torch.bool}

# Exact types read without further questions (the hot path: many small calls per step).
PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})

# OVERFLOW_FAST_CPU_AS_DEVICE=1: CPU tensors count as an accelerator's wherever the path depends on
# the device (no host read inside the engine, deferral): the accelerators' path, testable without one.
# Read once, here; what takes one path or the other asks ``host_device_types`` where it is made
# and holds the answer, so that no call branches on it.
CPU_AS_DEVICE = os.environ.get("OVERFLOW_FAST_CPU_AS_DEVICE", "") not in ("", "0")


def host_device_types():
    """The device types whose tensors take the host's path (their rows written in host memory, a
    CPU float read with an early exit): the CPU's, none with ``CPU_AS_DEVICE``."""
    return frozenset() if CPU_AS_DEVICE else frozenset({"cpu"})


def tensor_device(device):
    """``device`` (a torch.device, a string or an index) as the tensors on it report theirs: an
    accelerator's with its index (``"cuda"`` is the current CUDA device), the CPU's without one.
    Every table kept per device is keyed by this form, where a device enters the engine: a key
    of another form misses every tensor's lookup."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type == "cpu":
        return _CPU if device.index is not None else device
    if device.index is None:
        if device.type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        accelerator = getattr(torch, "accelerator", None)  # xpu, mps, ...: torch >= 2.7
        index = getattr(accelerator, "current_device_index", None)
        if index is not None and accelerator.is_available() and accelerator.current_accelerator().type == device.type:
            return torch.device(device.type, index())
    return device


_CPU = torch.device("cpu")
_PYTHON_KEY = torch._C.DispatchKey.Python
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                             torch.sparse_bsc})

# How a tensor is read: KERNEL reads ``target`` (a plain tensor) with the fastest backend;
# OPS computes the row with torch ops on ``target`` (a dispatch subclass), then makes it plain.
KERNEL, OPS = "kernel", "ops"

MAX_REASON = 80


class Plan:
    """How to read one tensor: ``target`` through ``route``; ``dense_numel`` is set for a sparse
    tensor, whose row must then count ``dense_numel - target.numel()`` implicit zeros."""

    __slots__ = ("target", "route", "dense_numel")

    def __init__(self, target, route=KERNEL, dense_numel=None):
        self.target = target
        self.route = route
        self.dense_numel = dense_numel


def is_plain(tensor: torch.Tensor) -> bool:
    """A plain, storage-backed, strided tensor of a dtype the kernels read."""
    return (type(tensor) in PLAIN_TYPES and tensor.layout == torch.strided and not tensor.is_nested
            and not tensor.is_meta and not tensor.is_quantized and tensor.dtype in SUPPORTED_DTYPES
            and not is_functorch_wrapped(tensor))


def is_functorch_wrapped(tensor):
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def short_reason(reason: str) -> str:
    """One line of at most MAX_REASON characters."""
    reason = " ".join(reason.split())
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


def plan(tensor: torch.Tensor):
    """A :class:`Plan` for ``tensor``, or a string: the reason the engine cannot read it."""
    try:
        result = _plan(tensor)
    except Exception as error:  # a subclass whose accessors fail is unreadable, not fatal
        result = f"{type(tensor).__name__}: {type(error).__name__}: {error}"
    return short_reason(result) if isinstance(result, str) else result


def is_zero3_released(tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter outside the forward of its module: an empty placeholder whose
    values live, one partition per rank, in ``ds_tensor``."""
    return ("deepspeed" in sys.modules and tensor.numel() == 0
            and getattr(tensor, "ds_tensor", None) is not None and getattr(tensor, "ds_numel", 0) > 0)


def zero3_partition(tensor):
    """This rank's elements of a released ZeRO-3 parameter: its partition without the zeros that
    pad the last partitions (partition ``r`` holds flat elements ``[r * size, (r + 1) * size)``)."""
    partition = tensor.ds_tensor
    size = partition.numel()
    start = size * getattr(tensor, "ds_zero_partition_rank", 0)
    return partition.reshape(-1).narrow(0, 0, max(0, min(size, tensor.ds_numel - start)))


def _plan(tensor):
    if type(tensor) in PLAIN_TYPES and is_plain(tensor):
        if is_zero3_released(tensor):  # combining the partitions across ranks is the caller's
            return _plan(zero3_partition(tensor))
        return Plan(tensor)
    # Subclasses first: their layout, device and dtype are what they say, not what they hold.
    if type(tensor) not in PLAIN_TYPES:
        if torch._C._dispatch_keys(tensor).has(_PYTHON_KEY):
            return _plan_dispatch_subclass(tensor)
        if is_functorch_wrapped(tensor):
            return "tensors inside a functorch transform (vmap, grad) are not supported"
        # a __torch_function__ subclass owns its memory: read it as the plain tensor it is
        with torch._C.DisableTorchFunctionSubclass():
            tensor = tensor.as_subclass(torch.Tensor)
        return _plan(tensor)
    if is_functorch_wrapped(tensor):
        return "tensors inside a functorch transform (vmap, grad) are not supported"
    if tensor.is_meta:
        return "meta tensors hold no data"
    if tensor.is_quantized:
        return "quantized tensors are not supported"
    if tensor.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(tensor.dtype).replace('torch.', '')} is not supported"
    if tensor.is_nested:  # strided layout (the jagged one is a dispatch subclass)
        return _plan(_nested_elements(tensor))
    if tensor.layout in _SPARSE_LAYOUTS:
        if tensor.layout == torch.sparse_coo:
            values = (tensor if tensor.is_coalesced() else tensor.coalesce())._values()
        else:
            values = tensor.values()
        inner = _plan(values)
        if isinstance(inner, Plan):
            inner.dense_numel = tensor.numel()
        return inner
    if tensor.layout != torch.strided:
        return f"{str(tensor.layout).replace('torch.', '')} layout is not supported"
    return Plan(tensor)


def _nested_elements(tensor):
    """The elements of a nested tensor: its values buffer when that holds exactly them, else (a
    narrowed or transposed view) a copy of its components."""
    if tensor.is_contiguous():
        return tensor.values()
    return torch.cat([component.reshape(-1) for component in tensor.unbind()])


def _plan_dispatch_subclass(tensor):
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor):
        return "fake tensors hold no data"
    if tensor.is_meta:
        return "meta tensors hold no data"
    if tensor.is_nested:  # jagged
        return _plan(_nested_elements(tensor))
    to_local = getattr(tensor, "to_local", None)
    if _is_dtensor(tensor) and to_local is not None:
        return _plan(to_local())
    if tensor.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(tensor.dtype).replace('torch.', '')} is not supported"
    return Plan(tensor, OPS)


def _is_dtensor(tensor):
    api = dtensor_api()
    return api is not None and isinstance(tensor, api.DTensor)


def unreadable_reason(tensor: torch.Tensor):
    """Why the engine cannot read ``tensor``, or None when it can."""
    result = plan(tensor)
    return result if isinstance(result, str) else None
