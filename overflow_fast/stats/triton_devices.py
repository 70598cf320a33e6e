"""The per-hook read's state on each device (its accumulators and C++ launcher) and its self-check."""

import torch

from . import triton_launch, triton_table
from .layout import NUM_COLUMNS
from .triton_common import BLOCK_SIZE, BLOCKS_PER_CHUNK, SUPPORTED_DTYPES
from .triton_launch import _IDENTITY_ROW, MAX_SLOTS, STREAM_GROUPS, launch_path

# The first use of a CUDA device runs ``self_check``: a small fixed set of tensors through this
# path and through the torch backend, twice: first through Triton's launcher (which compiles the
# variants and checks the C++ packing against Triton's own argument handling), then through the
# direct launch. On any difference, or an error, it warns once and that device keeps the table
# kernels. Only after it passed does the launcher launch directly.

PER_HOOK = "per-hook kernel"
TABLE = "table kernels"


class _DeviceState:
    """What the per-hook read uses on one device."""

    __slots__ = ("device", "path", "self_check", "pool", "groups", "check_ms", "launcher", "launch_reason",
                 "compiled", "refused", "shapes", "warned", "__weakref__")

    def __init__(self, device):
        self.device = device
        self.path = PER_HOOK
        self.self_check = "not run"
        self.groups = {}  # stream handle -> address of its accumulator group (the Python read only)
        self.check_ms = None
        # (K, FORMATS, ANY_UNALIGNED, BLOCK_SIZE, BLOCKS_PER_CHUNK) -> the compiled kernel registered
        # for direct launches (kept: Triton unloads its CUfunction with it), or why it was refused
        self.compiled = {}
        self.refused = {}
        self.shapes = {}  # (block_size, blocks_per_chunk) -> (launcher, its accumulators) of a test's launch shape
        self.warned = False
        with triton_table.on_device(device):
            identity = torch.tensor(_IDENTITY_ROW, dtype=torch.int64)
            self.pool = identity.repeat(STREAM_GROUPS * MAX_SLOTS, 1).to(device)
        self.launcher, self.launch_reason = triton_launch._new_launcher(self, self.pool, BLOCK_SIZE, BLOCKS_PER_CHUNK)

    @property
    def launch(self):
        """How the per-hook kernel is launched here now (``launch_path``)."""
        return launch_path(self)

    def launcher_for(self, block_size, blocks_per_chunk):
        """The launcher of a launch shape: this device's own for the default one; tests' small chunks
        get one each, with accumulators of their own."""
        shape = (block_size, blocks_per_chunk)
        if shape == (BLOCK_SIZE, BLOCKS_PER_CHUNK) or self.launcher is None:
            return self.launcher
        known = self.shapes.get(shape)
        if known is None:
            with triton_table.on_device(self.device):
                pool = torch.tensor(_IDENTITY_ROW, dtype=torch.int64).repeat(STREAM_GROUPS * MAX_SLOTS, 1)
            pool = pool.to(self.device)
            known = self.shapes[shape] = (triton_launch._new_launcher(self, pool, *shape)[0], pool)
            if self.launcher.driver == "cuda" and self.self_check == "passed":
                known[0].allow_direct()
        return known[0]



_DEVICES = {}  # (device type, index) -> _DeviceState
_warned_devices = set()


def _state(device):
    key = (device.type, device.index)
    state = _DEVICES.get(key)
    if state is None:
        state = check_device(device)
    return state


def launcher(device):
    """The C++ launcher of the per-hook read on ``device`` (set up and self-checked on first use),
    for a hook's C++ core to launch through; None where that device does not take the per-hook
    kernel or there is no extension."""
    state = _state(torch.device(device))
    if state.path is not PER_HOOK or state.launcher is None or state.launcher.disabled is not None:
        return None
    return state.launcher


def check_device(device, read=None):
    """Set up the per-hook read on ``device`` and, on a CUDA device, run ``self_check`` (once per
    process and device; ``read``: the path checked, default this one; tests pass a wrong one).
    A failed check warns once and leaves the device on the table kernels. Returns its state."""
    device = torch.device(device)
    key = (device.type, device.index)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"overflow_fast: the first read on {device} is inside CUDA graph capture; its "
                           "self-check needs one eager call first (run one step before capturing)")
    state = _DEVICES[key] = _DeviceState(device)
    if device.type == "cuda" or read is not None:
        import time

        started = time.perf_counter()
        try:
            problem = self_check(device, read)
        except Exception as error:  # noqa: BLE001 - a failing fast path must not fail the read
            problem = f"{type(error).__name__}: {error}"
        state.check_ms = (time.perf_counter() - started) * 1e3
        if problem is None:
            state.self_check = "passed"
            if read is None and state.launcher is not None and state.launcher.driver == "cuda":
                state.launcher.allow_direct()
        else:
            state.self_check = f"failed: {problem}"
            state.path = TABLE
            if key not in _warned_devices:
                _warned_devices.add(key)
                import warnings

                warnings.warn(f"overflow_fast: the per-hook Triton kernel gave wrong statistics on {device} "
                              f"({problem}); that device uses the table kernels", RuntimeWarning, stacklevel=3)
    else:
        state.self_check = "not run (CPU tensors under the interpreter)"
    return state


def forget_devices():
    """Forget every device's state: the next read on each sets it up and checks it again."""
    _DEVICES.clear()
    _warned_devices.clear()


def device_report():
    """{device name: (path, self-check, launch)} of the devices used (or checked) so far."""
    return {str(state.device): (state.path, state.self_check, launch_path(state)) for state in _DEVICES.values()}
def _check_set(device):
    """The self-check's tensors: every dtype's special values and random bit patterns, empty and
    0-dim tensors, an unaligned view, a transposed (dense) one, and bf16 and int64 tensors that
    span several programs with their specials in the middle and last chunks."""
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
        tensors += [special, noise]
    chunk = BLOCK_SIZE * BLOCKS_PER_CHUNK
    wide = torch.full((2 * chunk + 77,), 1.5, dtype=torch.bfloat16)
    wide[chunk + 5] = float("nan")
    wide[-1] = -float("inf")
    wide[-2] = 2.0**-130
    ints = torch.arange(chunk + 3, dtype=torch.int64)
    ints[-1] = -(2**63)
    square = torch.randint(-100, 100, (30, 40), generator=gen).to(torch.float16)
    tensors += [wide, wide[1:], ints, torch.empty(0, dtype=torch.float32), torch.tensor(-3.0), square.t(),
                torch.zeros(70, dtype=torch.float32)[1:]]
    return [t.to(device) for t in tensors]



def self_check(device, read=None):
    """None when the per-hook read (``read(tensors, rows)`` on up to MAX_SLOTS tensors at a time,
    default this device's per-hook read) gives the torch backend's rows for ``_check_set`` twice in
    a row, else the first difference. The default read goes through the device's C++ launcher, the
    hooks' own path: the first time through Triton's launch (which compiles each variant, then
    registers it), the second time directly wherever a variant is registered; where no launch of
    the second time could be direct, the device's launch path says why."""
    from . import torch_backend

    tensors = _check_set(device)
    want = torch_backend.compute(tensors).cpu()
    state = None
    if read is None:
        state = _DEVICES.get((device.type, device.index)) or _DeviceState(device)
        _check_stream(state)
    for attempt in ("first", "second"):
        reader = read if state is None else _checked_read(state, attempt)
        rows = torch.full((len(tensors), NUM_COLUMNS), -1, dtype=torch.int64, device=device)
        for begin in range(0, len(tensors), MAX_SLOTS):  # one launch each, as a hook's call
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


def _checked_read(state, attempt):
    """``self_check``'s default read on ``state``'s device, ``attempt`` "first" or "second": the
    launcher's (Triton's launch, then the direct one), or the Python read where there is none."""
    launcher = state.launcher
    if launcher is None:
        from . import triton_read  # the read builds on this module: imported when first needed

        return lambda tensors, rows: triton_read._read(tensors, rows, state)

    def read(tensors, rows):
        before = launcher.direct_launches
        taken = launcher.read(tensors, rows, -1 if attempt == "first" else 1)
        if taken and attempt == "second" and launcher.driver == "cuda" and launcher.direct_launches == before:
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


