"""The list read's state on each device: its accumulators, its C++ launcher and what its first use
found. Set up and self-checked by ``triton_list`` (the read), looked up here by device."""

import torch

from . import triton_launch, triton_table
from .kinds import tensor_device
from .triton_common import BLOCK_SIZE, BLOCKS_PER_CHUNK
from .triton_launch import _IDENTITY_ROW, MAX_SLOTS, STREAM_GROUPS, launch_path

# The path a device's reads of a few tensors take: the list kernel (a call's tensors passed by
# value, one launch per MAX_SLOTS of them), or, where its self-check failed, the table kernels.
LIST = "list kernel"
TABLE = "table kernels"


class _DeviceState:
    """What the list read uses on one device (``device``: as its tensors report it)."""

    __slots__ = ("device", "path", "self_check", "pool", "groups", "check_ms", "launcher", "launch_reason",
                 "compiled", "refused", "shapes", "warned", "probe", "__weakref__")

    def __init__(self, device):
        self.device = device
        self.path = LIST
        self.self_check = "not run"
        self.groups = {}  # stream handle -> address of its accumulator group (the Python read only)
        self.check_ms = None
        # (K, FORMATS, ANY_UNALIGNED, BLOCK_SIZE, BLOCKS_PER_CHUNK) -> the compiled kernel registered
        # for direct launches (kept: Triton unloads its CUfunction with it), or why it was refused
        self.compiled = {}
        self.refused = {}
        self.shapes = {}  # (block_size, blocks_per_chunk) -> (launcher, its accumulators) of a test's launch shape
        self.warned = False
        self.probe = None  # the direct launch's verdict on this device (triton_verdicts), once known
        self.pool = self.launcher = self.launch_reason = None

    def set_up(self):
        """Allocate the accumulators on the device and make its C++ launcher (what may fail: the
        caller guards it)."""
        with triton_table.on_device(self.device):
            identity = torch.tensor(_IDENTITY_ROW, dtype=torch.int64)
            self.pool = identity.repeat(STREAM_GROUPS * MAX_SLOTS, 1).to(self.device)
        self.launcher, self.launch_reason = triton_launch._new_launcher(self, self.pool, BLOCK_SIZE, BLOCKS_PER_CHUNK)

    @property
    def launch(self):
        """How the list kernel is launched here now (``launch_path``)."""
        return launch_path(self)

    def launchers(self):
        """Every C++ launcher of this device: its own and those of the tests' launch shapes."""
        return [launcher for launcher in [self.launcher, *(known[0] for known in list(self.shapes.values()))]
                if launcher is not None]

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
            if self.launcher.direct_allowed:
                known[0].allow_direct()
        return known[0]


_DEVICES = {}  # (device type, index) of a device as its tensors report it -> _DeviceState
_warned_devices = set()


def key(device):
    """The key of ``device`` (any form: "cuda", "cuda:1", an int) in the per-device tables."""
    device = tensor_device(device)
    return device.type, device.index


def lookup(device):
    """The state of ``device`` where it is set up, else None."""
    return _DEVICES.get(key(device))


def forget_devices():
    """Forget every device's state: the next read on each sets it up and checks it again."""
    _DEVICES.clear()
    _warned_devices.clear()


def forget(device):
    """Forget ``device``'s state (``overflow-fast info`` set it up only to report it)."""
    _DEVICES.pop(key(device), None)


def device_report():
    """{device name: (path, self-check, launch)} of the devices used (or checked) so far."""
    return {str(state.device): (state.path, state.self_check, launch_path(state)) for state in _DEVICES.values()}
