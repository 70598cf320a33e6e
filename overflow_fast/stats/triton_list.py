"""The list read: ``read_into`` passes a call's tensors to the list kernel by value (address,
element count, format word), one launch per MAX_SLOTS of them, nothing uploaded; and its first use
on a device (``check_device``: the device's state set up, then its self-check)."""

import contextlib
import sys
import time
import warnings

import torch

from . import torch_backend, triton_common, triton_devices, triton_kernels, triton_table, triton_verdicts
from .kinds import is_zero3_released, tensor_device
from .layout import NUM_COLUMNS
from .triton_common import (_ALIGNED_BIT, _CODE_MASK, _FORMAT_WORD, _PLAIN_TYPES, BLOCK_SIZE, BLOCKS_PER_CHUNK,
                            NUM_WARPS, SUPPORTED_DTYPES, _functorch_interpreter, _REGISTER_CAP, format_groups)
from .triton_devices import LIST, TABLE, _DeviceState
from .triton_launch import MAX_READ_LAUNCHES, MAX_SLOTS, SLOT_VARIANTS, STREAM_GROUPS

# -- the list read: one launch per MAX_SLOTS tensors, nothing uploaded ----------------------------
#
# ``read_into`` reads the few tensors of one call (and, through a launcher bound by a caller's C++
# code, what that code's one call passes: ``launcher``). The tensors' addresses, element counts
# and format words go to ``_list_kernel`` as scalar arguments (as apex's and PyTorch's
# multi-tensor kernels pass their pointers by value), so nothing is uploaded and the launch is the
# call's only device work. Variants by tensor count (SLOT_VARIANTS); a call with more tensors than
# the largest takes one launch per MAX_SLOTS of them, up to MAX_READ_LAUNCHES, and the table
# kernels (``compute``: two launches and an upload whatever the count) past that.
#
# How one kernel writes final rows: a tensor read by one program (up to one chunk, most tensors)
# writes its row directly. A tensor spanning several programs merges their partials with integer
# atomics into an accumulator row and the last program to finish writes the row (``_merge``).
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
    ``out`` (a contiguous ``[len(tensors), 8]`` int64 tensor on their device), by the list
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
    state = triton_devices._DEVICES.get((device.type, device.index))  # a tensor's device: the key's form
    if state is None:
        if not triton_common.supports(tensors[0]):
            return False
        state = device_state(device)
    if state.path is not LIST:
        return False
    launcher = state.launcher_for(block_size, blocks_per_chunk)
    if launcher is not None and launcher.disabled is not None:
        if not state.warned:
            state.warned = True
            warnings.warn(f"overflow_fast: the list kernel's launch failed on {device} ({launcher.disabled}); "
                          "that device's reads take the table kernels", RuntimeWarning, stacklevel=2)
        return False
    return _read(tensors, out, state, block_size, blocks_per_chunk)


def _read(tensors, out, state=None, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK):
    """``read_into`` on a device whose state is set up (``state``, default looked up), whatever its
    self-check said: its C++ launcher's read, the one owner of the device's accumulators, or
    without the extension the Python read."""
    if state is None:
        state = triton_devices.lookup(out.device)
    launcher = state.launcher_for(block_size, blocks_per_chunk)
    if launcher is not None:
        return launcher.disabled is None and launcher.read(tensors if type(tensors) is list else list(tensors), out)
    return _python_read(tensors, out, state, block_size, blocks_per_chunk)


def _python_read(tensors, out, state, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK):
    """The list read in Python, where the C++ launcher is not available (no extension): the
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
            formats = unaligned = 0
            for slot in group:
                args += slot
                formats |= 1 << (slot[2] & _CODE_MASK)
                unaligned |= 0 if slot[2] & _ALIGNED_BIT else 1 << (slot[2] & _CODE_MASK)
            args += _PADDING * (MAX_SLOTS - len(group))
            # one launch per group of formats, as the C++ launcher makes them
            for these, any_unaligned in format_groups(formats, unaligned):
                _launch_read(programs[launch], args, _variant(len(group)), these, any_unaligned, block_size,
                             blocks_per_chunk)
    del keep
    return True


def _launch_read(programs, args, slots, formats, any_unaligned, block_size, blocks_per_chunk):
    """One launch of ``_list_kernel`` (Triton's ordinary call) of the Python read."""
    triton_kernels._list_kernel[(programs,)](*args, K=slots, FORMATS=formats, ANY_UNALIGNED=any_unaligned,
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


# -- first use on a device: its state and self-check ------------------------------------------------
#
# The first use of a CUDA device runs ``self_check``: a small fixed set of tensors through this
# path and through the torch backend, twice, every launch through Triton's own launcher (which
# compiles the variants, then registers them for the direct launch). On any difference, or an
# error, it warns once and that device keeps the table kernels. Then the direct launch waits for
# its verdict (triton_verdicts: a probe in a child process, once per kind of GPU, driver, Triton
# and build), the only place where a first direct launch is made.


def device_state(device):
    """The list read's state on ``device`` (any form of it), set up and self-checked on first use."""
    state = triton_devices.lookup(device)
    return state if state is not None else check_device(device)


def launcher(device):
    """The C++ launcher of the list read on ``device`` (set up and self-checked on first use), for
    a caller's C++ code to launch through; None where that device does not take the list kernel or
    there is no extension."""
    state = device_state(device)
    if state.path is not LIST or state.launcher is None or state.launcher.disabled is not None:
        return None
    return state.launcher


def check_device(device, read=None, direct=False, before_direct=None, probe=True):
    """Set up the list read on ``device`` (any form of it) and, on a CUDA device, run
    ``self_check`` (once per process and device; ``read``: the path checked, default this one;
    tests pass a wrong one). A set-up or a check that fails warns once and leaves the device on the
    table kernels. Then the direct launch's verdict decides whether it launches directly
    (``probe``: start a probe where none is known); ``direct``: the probe's own process, which
    checks the direct launch here instead (``before_direct`` is called before its first one).
    Returns its state."""
    device = tensor_device(device)
    key = (device.type, device.index)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"overflow_fast: the first read on {device} is inside CUDA graph capture; its "
                           "self-check needs one eager call first (run one step before capturing)")
    state = triton_devices._DEVICES[key] = _DeviceState(device)
    checks = device.type == "cuda" or read is not None
    started = time.perf_counter()
    stage = "set-up: "
    try:  # a failing fast path must not fail the read: whatever fails here leaves the table kernels
        state.set_up()
        stage = ""
        problem = self_check(device, read, state, direct, before_direct) if checks else None
    except Exception as error:  # noqa: BLE001
        problem = f"{stage}{type(error).__name__}: {error}"
    if checks or problem is not None:
        state.check_ms = (time.perf_counter() - started) * 1e3
    if problem is None:
        state.self_check = "passed" if checks else "not run (CPU tensors under the interpreter)"
        if direct and state.launcher is not None:
            state.probe = "is tried in this process (the probe's)"
            state.launcher.allow_direct()
        elif read is None:
            triton_verdicts.first_use(state, start=probe)
    else:
        state.self_check = f"failed: {problem}"
        state.path = TABLE
        if key not in triton_devices._warned_devices:
            triton_devices._warned_devices.add(key)
            warnings.warn(f"overflow_fast: the list kernel gave wrong statistics on {device} "
                          f"({problem}); that device uses the table kernels", RuntimeWarning, stacklevel=3)
    return state


def _check_set(device):
    """The self-check's tensors: every dtype's special values and random bit patterns, empty and
    0-dim tensors, and bf16 and int64 tensors that span several programs with their specials in the
    middle and last chunks; and views made on the device (as a caller's are): unaligned starts, one
    deep into its storage, a transposed and a permuted one (dense), a gapped one (read through a
    copy)."""
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for dtype in sorted(SUPPORTED_DTYPES, key=str):
        size = dtype.itemsize
        if dtype.is_floating_point and size == 1:
            special = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)  # every byte
        elif dtype.is_floating_point:
            info = torch.finfo(dtype)
            special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.tiny, -info.tiny / 4,
                                    info.max, -info.max, 1.0, -2.5], dtype=torch.float64).to(dtype)
        elif dtype == torch.bool:
            special = torch.tensor([True, False, True])
        else:
            signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
            info = torch.iinfo(signed)
            special = torch.tensor([0, -1, 1, info.min, info.max, info.min + 1], dtype=signed)
            special = special.view(dtype) if dtype != torch.uint8 else special.view(torch.uint8)
        if dtype == torch.bool:
            noise = torch.randint(0, 2, (77,), generator=gen, dtype=torch.uint8).view(torch.bool)
        else:
            noise = torch.randint(-128, 128, (77 * size,), generator=gen, dtype=torch.int8).view(dtype)
        tensors += [special.to(device), noise.to(device)]
    chunk = BLOCK_SIZE * BLOCKS_PER_CHUNK
    wide = torch.full((2 * chunk + 77,), 1.5, dtype=torch.bfloat16)
    wide[chunk + 5] = float("nan")
    wide[-1] = -float("inf")
    wide[-2] = 2.0**-130
    ints = torch.arange(chunk + 3, dtype=torch.int64)
    ints[-1] = -(2**63)
    square = torch.randint(-100, 100, (30, 40), generator=gen).to(torch.float16)
    cube = torch.randint(-100, 100, (4, 5, 6), generator=gen).to(torch.float32)
    cube[3, 4, 5] = float("inf")
    wide, ints, square, cube = (t.to(device) for t in (wide, ints, square, cube))
    zeros = torch.zeros(70, dtype=torch.float32, device=device)
    tensors += [wide, wide[1:], wide[chunk + 3:2 * chunk + 60], ints, torch.empty(0, dtype=torch.float32, device=device),
                torch.tensor(-3.0, device=device), square.t(), square[:, 1::3], cube.permute(2, 0, 1), zeros[1:]]
    return tensors


def self_check(device, read=None, state=None, direct=False, before_direct=None):
    """None when the list read (``read(tensors, rows)`` on up to MAX_SLOTS tensors at a time,
    default this device's list read) gives the torch backend's rows for ``_check_set`` twice in
    a row, else the first difference. The default read goes through the device's C++ launcher, the
    path its callers take, each time through Triton's launch (the first compiles each variant, then
    registers it); with ``direct`` (the probe's process) the second time directly wherever a variant
    is registered (``before_direct`` called first), and where none of its launches could be direct,
    the device's launch path says why."""
    device = tensor_device(device)
    tensors = _check_set(device)
    want = torch_backend.compute(tensors).cpu()
    if read is None:
        state = state or triton_devices.lookup(device)
        if state is None:
            state = _DeviceState(device)
            state.set_up()
        _check_stream(state)
    for attempt in ("first", "second"):
        if attempt == "second" and direct and read is None and before_direct is not None:
            before_direct()
        reader = read if read is not None else _checked_read(state, attempt, direct)
        rows = torch.full((len(tensors), NUM_COLUMNS), -1, dtype=torch.int64, device=device)
        for begin in range(0, len(tensors), MAX_SLOTS):  # one launch each, as a caller's call
            if reader(tensors[begin:begin + MAX_SLOTS], rows[begin:begin + MAX_SLOTS]) is False:
                return f"the {attempt} read did not take the check's tensors"
        problem = _row_difference(rows.cpu(), want, tensors)
        if problem is not None:
            return f"{attempt} read: {problem}"
    return None


def _check_stream(state):
    """Raise unless the launcher's current stream is torch's (the stream its accumulators and
    launches follow)."""
    launcher = state.launcher
    if launcher is not None and launcher.driver == "cuda":
        stream = torch.cuda.current_stream(state.device).cuda_stream
        if launcher.current_stream() != stream:
            raise RuntimeError(f"the launcher's current stream {launcher.current_stream():#x} is not torch's "
                               f"{stream:#x}")


def _checked_read(state, attempt, direct=False):
    """``self_check``'s default read on ``state``'s device, ``attempt`` "first" or "second": the
    launcher's (Triton's launch; with ``direct`` the second time the direct one), or the Python
    read where there is none."""
    launcher = state.launcher
    if launcher is None:
        return lambda tensors, rows: _python_read(tensors, rows, state)

    def read(tensors, rows):
        before = launcher.direct_launches
        taken = launcher.read(tensors, rows, 1 if direct and attempt == "second" else -1)
        if taken and direct and attempt == "second" and launcher.driver == "cuda" and launcher.direct_launches == before:
            reason = next(iter(state.refused.values()), "no variant was registered")
            state.launch_reason = state.launch_reason or f"the self-check launched nothing directly: {reason}"
        return taken

    return read


def _row_difference(got, want, tensors):
    """The first row where ``got`` differs from ``want`` (host int64 [N, 8]), or None; NaN rows
    may hold another NaN pattern in the extremes."""
    for index, (g, w) in enumerate(zip(got.tolist(), want.tolist())):
        same = g[2:] == w[2:]
        if same and g[2] > 0 and tensors[index].is_floating_point():
            same = all((v & 0x7FFFFFFFFFFFFFFF) > 0x7FF0000000000000 for v in g[:2])
        elif same:
            same = g[:2] == w[:2]
        if not same:
            t = tensors[index]
            return f"tensors[{index}] {t.dtype} {tuple(t.shape)}: row {g}, torch backend {w}"
    return None


