"""Where a frame's statistics rows come from: read now (one engine call, one host read), or
deferred into a preallocated device buffer that is read once for many frames (check="batch").
Either way a tensor already read in this forward, unchanged, is not read again (``reuse``)."""

import ctypes
import sys
import warnings
import weakref

import torch

from . import distributed, native
from .stats import tensor_stats
from .stats.kinds import PLAIN_TYPES, is_zero3_released, short_reason
from .stats.layout import NAN, NEGINF, NUM_COLUMNS, POSINF


def _shard_infos(tensors):
    """Per tensor, what combining the rows of a DTensor's shards (or a ZeRO-3 parameter's
    partitions) across ranks needs (None for other tensors), or None when there is no such tensor
    among them (the common case: one type check per tensor)."""
    zero3 = "deepspeed" in sys.modules  # a released ZeRO-3 parameter is a plain, empty tensor
    if all(type(t) in PLAIN_TYPES and not (zero3 and is_zero3_released(t)) for t in tensors):
        return None
    infos = [distributed.shard_info(t) for t in tensors]
    return infos if any(info is not None for info in infos) else None


class RowReader:
    """Reads frames' tensors through ``tensor_stats``; if the engine fails on a call, it warns
    once and reads those tensors one at a time with the torch backend, so that only a tensor
    nothing can read loses its line."""

    def __init__(self, backend, reuse):
        self.backend = backend
        self.reuse = reuse
        self._warned = False

    def stats(self, tensors, out=None):
        """The StatsBatch of ``tensors``; if the engine failed: ``(host rows, {index: reason})``,
        the reasons for the tensors nothing could read (their rows are zeros)."""
        try:
            return tensor_stats(tensors, self.backend, out=out)
        except Exception as error:
            if not self._warned:
                self._warned = True
                warnings.warn(f"overflow_fast: tensor_stats failed ({type(error).__name__}: {error}); "
                              "the detector reads such tensors one at a time with the 'torch' "
                              "backend, with a host sync each", RuntimeWarning, stacklevel=5)
        rows = []
        reasons = {}
        for index, tensor in enumerate(tensors):
            try:
                rows.append(tensor_stats([tensor], "torch").host_rows()[0])
            except Exception as error:
                rows.append([0] * NUM_COLUMNS)
                reasons[index] = short_reason(f"{type(error).__name__}: {error}")
        return rows, reasons

    def read_now(self, frame, tensors):
        """Set ``frame.rows`` to host rows: one engine call and one host read for what is new."""
        sources, fresh = self.reuse.lookup(tensors)
        if fresh:
            result = self.stats([tensors[i] for i in fresh])
            engine_read = not isinstance(result, tuple)  # rows of a failed read are not reused
            if engine_read:
                rows = result.host_rows()
            else:
                rows, reasons = result
                for index, reason in reasons.items():
                    frame.mark_unreadable(fresh[index], reason)
            infos = _shard_infos([tensors[i] for i in fresh])
            if infos is not None:  # DTensor shards: the whole tensors' rows (one collective)
                bad = {}
                rows = distributed.global_rows(rows, infos, bad_shards=bad)
                for index, ranks in bad.items():
                    frame.mark_bad_shards(fresh[index], ranks)
            for position, row in zip(fresh, rows):
                sources[position] = row
                if engine_read:
                    self.reuse.remember(tensors[position], row)
        frame.rows = sources


# What a forward hook's tensor at a given position of a given module needs (DeferredRows.modes):
# not seen yet (read it in its hook, and watch whether it changes before the forward ends), seen
# unchanged until the forward ended (stage it), seen changed in place after its hook (read it in
# its hook from then on).
UNKNOWN, STAGE, AT_ONCE = 0, 1, 2

CHANGED_IN_PLACE = ("changed after this hook (in place, or its memory freed or swapped) before the forward's "
                    "read; read in its hook from now on")

DEFAULT_STAGE_BYTES = 256 << 20

# CPU tensors are read in their hooks: there the kernel runs in the calling thread, so staging
# saves no host work, and a tensor read in its hook is still in cache (a 4-layer GPT-2 forward
# at 4x384: +4% read in hooks, +15% read once at the end; RESULTS.md). Staging is for
# accelerators, whose host work per engine call is the cost. Tests and the host-path benchmark,
# which run the GPU path's host work on CPU tensors, turn it on (read when a device's buffer is
# made, at a detector's first call on that device).
STAGE_CPU_TENSORS = False


class _DeviceRows:
    """One device's buffer of rows: ``[0, launched)`` have their kernels enqueued, ``[launched,
    used)`` belong to staged tensors, read by the next launch."""

    __slots__ = ("buffer", "stages", "used", "launched", "staged", "versions", "pointers", "staged_bytes",
                 "infos", "stale", "unreadable", "slot_sources")

    def __init__(self, buffer):
        self.buffer = buffer
        self.stages = buffer.device.type != "cpu" or STAGE_CPU_TENSORS  # else each call is read at once
        self.slot_sources = []  # (self, slot) for each slot used so far: made once, shared by every forward
        self.used = 0
        self.launched = 0
        self.staged = []  # the tensors of slots [launched, used), kept alive until launched
        self.versions = []  # their version counters when their hook ran
        # and their data pointers (None for wrappers without one): neither `.data = ...` nor a
        # storage freed by `resize_(0)` (FSDP, ZeRO-3) bumps the version counter
        self.pointers = []
        self.staged_bytes = 0
        self.infos = None  # per slot: DTensor/ZeRO-3 shard info, or None when there is none
        self.stale = set()  # slots whose tensor changed in place before it was read
        self.unreadable = {}  # slot -> reason: nothing could read that tensor

    def drop_staged(self):
        """Forget the staged tensors (read by a launch, or discarded)."""
        self.staged = []
        self.versions = []
        self.pointers = []
        self.staged_bytes = 0

    def clear(self):
        self.used = self.launched = 0
        self.drop_staged()
        self.infos = None
        self.stale = set()
        self.unreadable = {}


class DeferredRows:
    """Calls waiting for their rows (check="batch").

    Inside a top-level forward a hook only *stages* its tensors (on accelerators: see
    STAGE_CPU_TENSORS): each gets the next row of its
    device's buffer, and the tensor waits, with its version counter, until one engine call per
    device reads every staged tensor (``launch``): when the forward ends, or earlier when
    ``stage_bytes`` of tensors that do not require grad wait (activations the forward would have
    freed: autograd keeps the others until backward anyway). ``read()`` then brings each buffer
    to the host in one copy.

    Staging changes *when* a tensor is read, so a tensor changed in place after its hook
    (``ReLU(inplace=True)`` on a layer's output, ``x += residual``) would show its later values.
    Each (module, tensor position) is therefore learned: the first time it is seen its tensor is
    read in the hook (launched at once: stream order, no host sync) and watched until the forward
    ends; unchanged, it is staged from then on; changed, it is always read in its hook. A staged
    tensor found changed at launch (a pattern not seen before) gets a line saying so, never its
    later numbers, and is read in its hook from then on.
    """

    def __init__(self, reader, capacity, stage_bytes=DEFAULT_STAGE_BYTES):
        self.reader = reader
        self.capacity = capacity
        self.stage_bytes = stage_bytes
        self.pending = []  # calls in hook order
        self._devices = {}  # device -> _DeviceRows
        self.modes = {}  # module -> [UNKNOWN | STAGE | AT_ONCE per tensor position]
        self._watched = []  # (tensor, version, data pointer, modes, position): read at once, first seen
        self._watched_bytes = 0
        self._host_rows = False  # a pending frame holds host rows (read apart, or a compiled graph's)
        self._last_state = None  # the device buffer of the last staged call
        self._pending_modes = []  # per pending call: the staging modes its tensors were added with, or None

    def __len__(self):
        return len(self.pending)

    def must_read_before(self, tensors):
        """True when adding a call with these tensors would overflow the queue or a buffer (with
        several devices: the fullest one's)."""
        if len(self.pending) >= self.capacity:
            return True  # calls without tensors take no rows, but their frames wait all the same
        if tensors and len(tensors) <= self.capacity:
            last = self.capacity - len(tensors)
            for state in self._devices.values():
                if state.used > last:
                    return True
        return False

    def add(self, call, tensors, module=None):
        """Queue a call; ``frame.rows`` holds, per tensor, a host row or the (device rows, slot)
        where its row will be. ``module``: the forward hook's module, whose tensors may be staged
        (None: read them now). ``tensors`` None: the frame's rows are on the host already. Call
        ``must_read_before`` first."""
        frame = call.frame
        self.pending.append(call)
        self._pending_modes.append(None)
        if not tensors:
            if tensors is None:
                self._host_rows = True
            else:
                frame.rows = []
            return
        if len(tensors) > self.capacity:
            self._host_rows = True
            self.reader.read_now(frame, tensors)
            return
        # Most calls are on the device of the call before: the C++ loop checks that as it goes
        # (False: another device) and takes plain tensors only (None); the rest find their device.
        state = self._last_state
        staged = None
        if state is not None and native.stage_tensors is not None:
            modes = self._modes(module, len(tensors)) if state.stages else None
            staged = native.stage_tensors(tensors, self.reader.reuse.open_rows(len(tensors)), state, modes,
                                          self._watched)
        plain = bool(staged)  # the C++ loop took them: plain tensors
        if not plain:
            state = self._state_of(tensors)
            if state is None:  # one call, several devices: read now, host rows
                self._host_rows = True
                self.reader.read_now(frame, tensors)
                return
            self._last_state = state
            modes = self._modes(module, len(tensors)) if state.stages else None
            known = self.reader.reuse.open_rows(len(tensors))
            staged = native.stage_tensors(tensors, known, state, modes, self._watched) if native.stage_tensors else None
            plain = bool(staged)
            if not plain:
                staged = _stage(tensors, known, state, modes, self._watched)
        start = state.used
        sources, state.used, launch_now, staged_bytes, watched_bytes = staged
        state.staged_bytes += staged_bytes
        self._watched_bytes += watched_bytes
        added = state.used - start
        if added and (not plain or "deepspeed" in sys.modules or state.infos is not None):
            # DTensor shards and ZeRO-3 partitions: which slots hold them, combined across ranks when read
            infos = _shard_infos(state.staged[len(state.staged) - added:])
            if infos is not None or state.infos is not None:
                state.infos = (state.infos or [None] * start) + (infos or [None] * added)
        frame.rows = sources
        self._pending_modes[-1] = modes
        if launch_now or state.staged_bytes + self._watched_bytes > self.stage_bytes:
            self.launch()

    def stage(self, call, tensors, module):
        """``must_read_before`` then ``add`` of a forward hook's call inside a top-level forward, in
        one C++ call (``native.stage_call``) where that is the common case: plain tensors on the
        device of the call before, room to spare, no DTensor shards or, with DeepSpeed loaded,
        empty tensors (ZeRO-3 placeholders), the module seen before. False when the caller must
        take those two steps itself (nothing was changed)."""
        if native.stage_call is None:
            return False
        launch = native.stage_call(self, self.reader.reuse, call, tensors, module)
        if launch is None:
            return False
        if launch:
            self.launch()
        return True

    def _state_of(self, tensors):
        """The buffer of the device all ``tensors`` are on (made on first use), or None when they
        are on several."""
        first = tensors[0]
        if len(tensors) > 1:
            index = first.get_device()
            for tensor in tensors:
                if tensor.get_device() != index:
                    return None
        device = first.device
        state = self._devices.get(device)
        if state is None:
            buffer = torch.empty((self.capacity, NUM_COLUMNS), dtype=torch.int64, device=device)
            state = self._devices[device] = _DeviceRows(buffer)
        return state

    def _modes(self, module, count):
        """The staging modes of ``module``'s tensor positions (None: not a forward hook's call
        inside a top-level forward, read at once)."""
        if module is None:
            return None
        modes = self.modes.get(module)
        if modes is None or len(modes) < count:
            modes = self.modes[module] = (modes or []) + [UNKNOWN] * (count - len(modes or ()))
        return modes

    def launch(self):
        """Enqueue the engine calls that read every staged tensor (one per device; no host sync)."""
        for state in self._devices.values():
            if state.used == state.launched:
                continue
            start, end = state.launched, state.used
            staged, versions, pointers = state.staged, state.versions, state.pointers
            if not (native.all_unchanged or _all_unchanged)(staged, versions, pointers):
                for offset, tensor in enumerate(staged):
                    if _changed_since(tensor, versions[offset], pointers[offset]):
                        self._changed(state, start + offset)
                        # never handed to the engine: its memory may be gone (torch's own ops on a
                        # storage resized to 0 read freed memory); its line says what happened
                        staged[offset] = torch.empty(0, dtype=torch.uint8, device=state.buffer.device)
            result = self.reader.stats(staged, out=state.buffer[start:end])
            if isinstance(result, tuple):  # the engine failed: the torch backend's rows
                rows, reasons = result
                state.buffer[start:end].copy_(torch.tensor(rows, dtype=torch.int64))
                for index, reason in reasons.items():
                    state.unreadable[start + index] = reason
            state.launched = end
            state.drop_staged()
        if self._watched_bytes > self.stage_bytes:
            self.learn()

    def learn(self):
        """Tensors read at once on their first sight: staged from now on if nothing changed them."""
        for tensor, version, pointer, modes, position in self._watched:
            if _changed_since(tensor, version, pointer):
                modes[position] = AT_ONCE
            elif modes[position] == UNKNOWN:
                modes[position] = STAGE
        self._watched = []
        self._watched_bytes = 0

    def _changed(self, state, slot):
        """A staged tensor changed in place before its launch: its row would be later numbers.
        Every entry showing it is read in its hook from now on: the pending calls' frames still
        hold their sources, so a scan finds them (this is the rare path; a list of entries per
        staged tensor would cost every hook)."""
        state.stale.add(slot)
        for call, modes in zip(self.pending, self._pending_modes):
            if modes is not None:
                for position, source in enumerate(call.frame.rows):
                    if type(source) is tuple and source[0] is state and source[1] == slot:
                        modes[position] = AT_ONCE

    def read(self, lazy=False):
        """``(calls, rows)``: the pending calls, in order; the queue and the buffers start empty
        again. ``rows`` is None when every frame has its host rows.

        ``lazy``: the caller needs nothing from a read without nan/inf but the rows of the
        frames it keeps. Then, when one device holds every row, none is marked and none counts
        a nan/inf, the frames keep their sources and ``rows`` is that device's host rows
        (``to_host``): ``resolve(frame, rows)`` gives a kept frame its rows."""
        self.launch()
        self.learn()
        calls = self.pending
        host_rows = self._host_rows
        # what needs no rows is done before the host read, which waits for the device
        marks = {}
        pending = []
        for state in self._devices.values():
            if state.used:
                key = id(state)
                for slot in state.stale:
                    marks[(key, slot)] = CHANGED_IN_PLACE
                for slot, reason in state.unreadable.items():
                    marks[(key, slot)] = reason
                pending.append((state, state.buffer[:state.used], state.infos))
        self.discard()
        if lazy and len(pending) == 1 and pending[0][2] is None and not marks and not host_rows:
            # the whole buffer in one copy, and no kernel of the read's own: the engine's
            # launches stay the forward's only ones
            state, rows, _ = pending[0]
            values, nonfinite = to_host(rows)
            if not nonfinite:
                return calls, values
            host = {id(state): (state, values.tolist())}
            pending = []
        else:
            host = {}
        bad = {}  # (device rows, slot) -> ranks whose DTensor shard holds a nan/inf
        for state, rows, infos in pending:
            if infos is not None:  # one collective per read, not per tensor
                shards = {}
                rows = distributed.global_rows(rows, infos, bad_shards=shards)
                bad.update(((id(state), slot), ranks) for slot, ranks in shards.items())
            host[id(state)] = (state, to_host(rows)[0].tolist())
        if len(host) == 1 and not marks and not bad:
            # the common case: one device, nothing to mark; a slot's row is its index
            (_, rows_of), = host.values()
            for call in calls:
                frame = call.frame
                frame.rows = [_row(rows_of, source[1]) if type(source) is tuple else source for source in frame.rows]
            return calls, None
        for call in calls:
            frame = call.frame
            rows = frame.rows
            for index, source in enumerate(rows):
                if isinstance(source, tuple):
                    key = (id(source[0]), source[1])
                    rows[index] = _row(host[key[0]][1], source[1])
                    if key in marks:
                        frame.mark_unreadable(index, marks[key])
                    if key in bad:
                        frame.mark_bad_shards(index, bad[key])
        return calls, None

    def discard(self):
        self.pending = []
        self._pending_modes = []
        self._host_rows = False
        self.reader.reuse.clear()  # the buffer slots are reused from here on
        for state in self._devices.values():
            state.clear()
        self._watched = []
        self._watched_bytes = 0


def to_host(rows):
    """The one host read of a device's rows (it waits for the device's work): ``(values,
    nonfinite)``, their values as a flat int64 memoryview copied out of the buffer, and whether a
    row counts a nan or an inf. Callers convert what they use to Python ints
    (``values[a:b].tolist()``): all of a forward's ~2,000 would cost more than the read."""
    if native.read_rows is not None:
        data, nonfinite = native.read_rows(rows)
        return memoryview(data).cast("q"), nonfinite
    host = rows.cpu().contiguous()
    values = memoryview(ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())).cast("q")
    return values, any(any(values[column::NUM_COLUMNS]) for column in (NAN, POSINF, NEGINF))


def _row(values, slot):
    return values[slot * NUM_COLUMNS:(slot + 1) * NUM_COLUMNS]


def resolve(frame, values):
    """Give a frame its host rows from ``values``, a device's rows as one flat memoryview
    (``to_host``): only the rows it names become Python ints."""
    if native.resolve_rows is not None:
        frame.rows = native.resolve_rows(frame.rows, values)
    else:
        frame.rows = [_row(values, source[1]).tolist() if type(source) is tuple else source
                      for source in frame.rows]


def _stage(tensors, known, state, modes, watched):
    """The hook's pass over its tensors (``DeferredRows.add``): a row this forward already has
    (same tensor, same version) serves again; a new tensor gets the next slot of ``state``, its
    version and data pointer, and is remembered in ``known`` (None: no reuse). ``modes``: the
    module's staging modes (None: read at once). Tensors first seen go to ``watched``.
    Returns ``(sources, used, launch_now, staged_bytes, watched_bytes)``. (A call per tensor, or
    a list per column, costs more than the work itself here; ``native.stage_tensors`` is its C++
    twin, for plain tensors.)"""
    launch_now = modes is None
    used = state.used
    staged, versions, pointers = state.staged, state.versions, state.pointers
    staged_bytes = watched_bytes = 0
    sources = []
    for position, tensor in enumerate(tensors):
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor: no version counter, so never staged or reused
            version = -1
        if known is not None and version >= 0:
            entry = known.get(id(tensor))
            if entry is not None and entry[1] == version and entry[0]() is tensor:
                source = entry[2]
                sources.append(source)
                if modes is not None and type(source) is tuple and modes[position] != STAGE:
                    # a tensor an earlier hook staged, at a position not known to stage: launch
                    # now if its row still waits
                    launch_now = launch_now or source[1] >= source[0].launched
                    if modes[position] == UNKNOWN:
                        watched.append((tensor, version, _pointer(tensor), modes, position))
                continue
        if used < len(state.slot_sources):
            source = state.slot_sources[used]
        else:
            source = (state, used)
            state.slot_sources.append(source)
        used += 1
        sources.append(source)
        pointer = _pointer(tensor)
        if version < 0:
            launch_now = True
        staged.append(tensor)
        versions.append(version)
        pointers.append(pointer)
        # only what staging alone keeps alive counts: autograd holds a tensor that
        # requires grad (weights, a training forward's activations) until backward anyway
        size = 0 if tensor.requires_grad else _bytes_of(tensor)
        staged_bytes += size
        if modes is not None:
            mode = modes[position]
            if mode != STAGE:
                launch_now = True
                if mode == UNKNOWN:
                    watched.append((tensor, version, pointer, modes, position))
                    watched_bytes += size
        if known is not None and version >= 0:
            try:
                known[id(tensor)] = (weakref.ref(tensor), version, source)
            except TypeError:  # a tensor subclass without weak references: read it again
                pass
    return sources, used, launch_now, staged_bytes, watched_bytes


def _bytes_of(tensor):
    try:
        return tensor.nbytes
    except RuntimeError:  # sparse tensors have no nbytes: their dense size bounds what they hold
        return tensor.numel() * tensor.element_size()


def _all_unchanged(tensors, versions, pointers):
    """True when no tensor changed since its version and pointer were taken (False: look at
    each); one comprehension per column instead of a call per tensor."""
    try:
        return ([t._version for t in tensors] == versions
                and [t.data_ptr() if type(t) in PLAIN_TYPES else None for t in tensors] == pointers)
    except RuntimeError:  # inference tensors (no version counter), storage-less ones: one at a time
        return False


def _changed_since(tensor, version, pointer):
    """Whether ``tensor`` changed since its version counter and data pointer were taken."""
    return _version(tensor) != version or (pointer is not None and tensor.data_ptr() != pointer)


def _pointer(tensor):
    """Where a plain tensor's data starts, or None (wrappers, sparse tensors: no one pointer)."""
    if type(tensor) not in PLAIN_TYPES:
        return None
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


def _version(tensor):
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter: never staged
        return -1
