"""The per-hook read: ``read_into``, one launch per MAX_SLOTS tensors, nothing uploaded."""

import contextlib
import sys

import torch

from . import triton_devices, triton_kernels, triton_common, triton_table
from .kinds import is_zero3_released
from .layout import NUM_COLUMNS
from .triton_common import (_ALIGNED_BIT, _CODE_MASK, _FORMAT_WORD, _PLAIN_TYPES, BLOCK_SIZE, BLOCKS_PER_CHUNK,
                            NUM_WARPS, _functorch_interpreter, _REGISTER_CAP)
from .triton_devices import PER_HOOK
from .triton_launch import MAX_READ_LAUNCHES, MAX_SLOTS, SLOT_VARIANTS, STREAM_GROUPS

# -- the per-hook read: one launch per MAX_SLOTS tensors, nothing uploaded ------------------------
#
# ``read_into`` is what the hook layer calls for a hook's new tensors (and, through a launcher bound
# to its C++ core, what each hook's one C++ call does: ``launcher``). The tensors' addresses,
# element counts and format words go to ``_read_kernel`` as scalar arguments (as apex's and
# PyTorch's multi-tensor kernels pass their pointers by value), so nothing is uploaded and the
# launch is the call's only device work. Variants by tensor count (SLOT_VARIANTS); a call with more
# tensors than the largest takes one launch per MAX_SLOTS of them, up to MAX_READ_LAUNCHES, and the
# table kernels (``compute``: two launches and an upload whatever the count) past that.
#
# How one kernel writes final rows: a tensor read by one program (up to one chunk, most of a
# model's) writes its row directly. A tensor spanning several programs merges their partials with
# integer atomics into an accumulator row and the last program to finish writes the row (``_merge``).
# The accumulators are not the destination rows because a row's final form (float64 bits, NaN
# poisoning both extremes) is not a lattice the atomics can build in place, and because rows given
# by the caller hold anything. They belong to the stream: each CUDA stream that runs the kernel on
# a device gets its own group of MAX_SLOTS rows from a pool allocated (at identity) on the device's
# first use, and every launch leaves its group at identity again. Kernels of one stream run one
# after another, so no two launches share a group at once; a graph captured on a stream keeps that
# stream's group (replaying one graph on two streams at once is unsound for any graph). Integer
# atomics are exact and their order does not change the result: the rows are the table kernels'
# bit for bit.

_STRIDED = torch.strided
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def read_into(tensors, out, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK):
    """The rows of ``tensors`` (a list of plain strided tensors on one device) written into
    ``out`` (a contiguous ``[len(tensors), 8]`` int64 tensor on their device), by the per-hook
    kernel: one launch per MAX_SLOTS tensors, nothing uploaded, no host sync. False when it does
    not take the call (nothing was launched): a tensor of another kind, device or dtype, more
    than MAX_SLOTS * MAX_READ_LAUNCHES tensors, ``out`` not such a tensor or sharing memory with
    a tensor, or this device's self-check failed; the caller then takes the general path.
    ``block_size`` and ``blocks_per_chunk`` override the launch shape (tests use small chunks)."""
    if not tensors:
        return True
    if _functorch_interpreter() is not None:
        return False  # inside vmap/grad: the general path says what it can read
    device = out.device
    state = triton_devices._DEVICES.get((device.type, device.index))
    if state is None:
        if not triton_common.supports(tensors[0]):
            return False
        state = triton_devices._state(device)
    if state.path is not PER_HOOK:
        return False
    launcher = state.launcher_for(block_size, blocks_per_chunk)
    if launcher is not None and launcher.disabled is not None:
        if not state.warned:
            state.warned = True
            import warnings

            warnings.warn(f"overflow_fast: the per-hook kernel's launch failed on {device} ({launcher.disabled}); "
                          "that device's reads take the table kernels", RuntimeWarning, stacklevel=2)
        return False
    return _read(tensors, out, state, block_size, blocks_per_chunk)


def _read(tensors, out, state=None, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK):
    """``read_into`` on a device whose state is set up (``state``, default looked up), whatever its
    self-check said: its C++ launcher's read, the one owner of the device's accumulators, or
    without the extension the Python read."""
    if state is None:
        state = triton_devices._DEVICES[(out.device.type, out.device.index)]
    launcher = state.launcher_for(block_size, blocks_per_chunk)
    if launcher is not None:
        return launcher.disabled is None and launcher.read(tensors if type(tensors) is list else list(tensors), out)
    return _python_read(tensors, out, state, block_size, blocks_per_chunk)


def _python_read(tensors, out, state, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK):
    """The per-hook read in Python, where the C++ launcher is not available (no extension): the
    same checks and arguments, each launch Triton's ordinary call."""
    count = len(tensors)
    if count > MAX_SLOTS * MAX_READ_LAUNCHES or _functorch_interpreter() is not None:
        return False
    device = out.device
    if (type(out) not in _PLAIN_TYPES or out.dtype != torch.int64 or tuple(out.shape) != (count, NUM_COLUMNS)
            or not out.is_contiguous()):
        return False
    out_first = out.data_ptr()
    out_last = out_first + count * 64
    cuda = device.type == "cuda"
    index = device.index if cuda else -1
    zero3 = "deepspeed" in sys.modules
    words = _FORMAT_WORD
    chunk = block_size * blocks_per_chunk
    slots = []  # (address, numel, word) per tensor
    programs = []  # per launch
    keep = None  # flat copies, alive until the launches are enqueued
    formats = 0
    any_unaligned = False
    for tensor in tensors:
        if (type(tensor) not in _PLAIN_TYPES or tensor.layout is not _STRIDED or tensor.is_cuda is not cuda
                or tensor.get_device() != index or tensor.is_meta):
            return False
        word = words.get(tensor.dtype)
        if word is None or tensor.is_nested or _is_functorch_wrapped(tensor):
            return False
        numel = tensor.numel()
        if numel == 0 and zero3 and is_zero3_released(tensor):
            return False  # a released ZeRO-3 parameter: the general path reads the whole one
        if not tensor.is_contiguous() and not triton_table._is_dense(tensor) or tensor.is_neg():
            tensor = triton_table._flat_source(tensor)
            keep = keep or []
            keep.append(tensor)
        elif numel and not _inside_storage(tensor):
            return False  # its memory was freed or shrunk: the general path says so
        slot = triton_table._slot(tensor, word)
        address = slot[0]
        if numel and address < out_last and out_first < address + numel * tensor.element_size():
            return False  # out shares memory with a tensor: the general path says so
        any_unaligned = any_unaligned or not slot[2] & _ALIGNED_BIT
        formats |= 1 << (word & _CODE_MASK)
        if len(slots) % MAX_SLOTS == 0:
            programs.append(0)
        programs[-1] += -(-numel // chunk) or 1
        slots.append(slot)
    stream = torch._C._cuda_getCurrentRawStream(index) if cuda else 0
    accumulators = state.groups.get(stream)
    if accumulators is None:
        if len(state.groups) >= STREAM_GROUPS:
            return False
        accumulators = state.groups[stream] = state.pool[len(state.groups) * MAX_SLOTS].data_ptr()
    # Triton launches on the current device: the tensors' one (cuda:1 under device_map="auto")
    guard = triton_table.on_device(device) if cuda and torch._C._cuda_getDevice() != index else contextlib.nullcontext()
    with guard:
        for launch, begin in enumerate(range(0, count, MAX_SLOTS)):
            group = slots[begin:begin + MAX_SLOTS]
            args = [out_first + begin * 64, accumulators]
            for slot in group:
                args += slot
            args += _PADDING * (MAX_SLOTS - len(group))
            _launch_read(programs[launch], args, _variant(len(group)), formats, any_unaligned, block_size,
                         blocks_per_chunk)
    del keep
    return True


def _launch_read(programs, args, slots, formats, any_unaligned, block_size, blocks_per_chunk):
    """One launch of ``_read_kernel`` (Triton's ordinary call) of the Python read."""
    triton_kernels._read_kernel[(programs,)](*args, K=slots, FORMATS=formats, ANY_UNALIGNED=any_unaligned,
                                             BLOCK_SIZE=block_size, BLOCKS_PER_CHUNK=blocks_per_chunk,
                                             num_warps=NUM_WARPS, **_REGISTER_CAP)


def _inside_storage(tensor):
    """Whether a dense tensor's elements lie inside its storage (a freed or shrunk storage would
    have the kernel read memory the tensor does not own)."""
    storage = tensor.untyped_storage()
    start = tensor.data_ptr() - storage.data_ptr()
    return storage.data_ptr() != 0 and 0 <= start and start + tensor.numel() * tensor.element_size() <= storage.nbytes()


def _variant(count):
    for slots in SLOT_VARIANTS:
        if slots >= count:
            return slots
    raise ValueError(count)


_PADDING = (0, -1, 0)  # an unused slot: no programs
