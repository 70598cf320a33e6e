"""When a hook's tensors are read, and where their statistics wait until the detector decides.

A hook's tensors are read in the hook, before anything can change them: one ``tensor_stats`` call
enqueues their statistics into rows of a preallocated buffer on their device (on an accelerator
no host sync), and the detector brings each buffer to the host once when it decides (at the end
of the outermost hooked call with check="batch", at every hook with check="module"). A tensor
already read in this pass and unchanged (the same tensor, version counter and data pointer; the
output of one module is the input of the next) keeps its row instead of being read again.

``defer=True`` (check="batch", off by default) lets a forward hook's tensors on an accelerator wait
and be read together when the pass ends: one engine call per pass instead of one per hook. Each
call site (a module's tensor position) is read in its hook the first time, and waits from the next
pass on only if nothing changed its tensor before that pass ended. The hole: a tensor that waits
and is then changed in place (a fix-up that runs only on a bad step, a new in-place op) has lost
the values its hook saw; its line says so (``CHANGED_AFTER_HOOK``), and a nan/inf it held then is
missed. Writes that bypass the version counter (``.data``, custom kernels) are read after the write.

The bookkeeping (rows, reuse, what waits) is the C++ ``HookCore`` (csrc/hooks.cpp), or without
the extension its Python twin (hook_core.py), which gives the same answers: the rows, their reuse
and what waits are the same on both paths, and on an accelerator no hook reads to the host. Once a
device's buffer exists, the backend's launcher (``rows_launcher``: the per-hook Triton kernel,
or the C++ kernel on the CPU) is bound to the C++ core, which then reads a hook's tensors itself:
the hook's classification, reuse check, packing and launch are one C++ call. Its answer says who
read them (``_taken``): the launcher, or this class, which reads what the launcher declined, and
what it failed on after one warning (the launcher then declines every read).
"""

import sys
import warnings

import torch

from .. import distributed
from .hook_core import HOOK_FULL, LAUNCH_FAILED, LAUNCHED, forward_call_function, new_core
from .frames import FORWARD, graph_task_id
from ..stats import tensor_stats
from ..stats.dispatch import rows_launcher, rows_reader
from ..stats.kinds import PLAIN_TYPES, host_device_types, is_zero3_released, short_reason
from ..stats.layout import NAN, NEGINF, NUM_COLUMNS, POSINF, host_bytes


MAX_REMEMBERED = 1 << 16  # tensors whose rows a pass remembers for reuse; past it the table starts over

CHANGED_AFTER_HOOK = ("changed after this hook (in place, or its memory freed or swapped) before its deferred "
                      "read; read in its hook from now on")


class Reads:
    """The rows of one detector's hook calls. ``add`` reads a call's tensors (or lets them wait) and
    returns its sources; ``read`` brings every row to the host; ``resolve`` gives a frame its rows;
    ``reset`` frees every row (after the calls that use them are replayed)."""

    def __init__(self, backend, capacity, reuse, stage_bytes):
        self.backend = backend
        self.capacity = capacity
        # which devices' rows are host memory, and whose tensors may wait (``may_wait``): decided here
        self._host_types = host_device_types()
        self.waits_on_cpu = "cpu" not in self._host_types  # (CPU tensors on the accelerators' path)
        self._core = new_core(capacity, stage_bytes, MAX_REMEMBERED if reuse else 0)
        self._forward_call = forward_call_function()
        self._buffers = {}  # device key -> [capacity, 8] int64 rows on that device
        self._host = {}  # device key -> (host rows [capacity, 8], the same memory as a flat int64 memoryview)
        self._readers = {}  # device key -> the backend's per-hook read there (None: tensor_stats)
        self._launchers = {}  # device key -> the launcher bound to the core there
        self._read_rows = {}  # device key -> rows brought to the host since the last reset
        self._marks = {}  # (device key, row) -> why that row's tensor could not be read
        self._shards = {}  # device key -> {row: ShardInfo} of DTensor and ZeRO-3 rows
        self._bad_shards = {}  # (device key, row) -> ranks whose shard holds the nan/inf
        self._apart_nonfinite = False  # a call read apart since the last reset counts a nan/inf
        self._warned = False

    def may_wait(self, defer, phase, trace_mode, tensors):
        """Whether a hook's tensors may be read later than in the hook: only with ``defer``, in a forward
        hook outside backward and inference mode (tensors without version counters can never be shown
        unchanged), on an accelerator. The core then lets wait only the call sites seen unchanged."""
        return phase == FORWARD and self.may_wait_in_forward(defer, trace_mode) and self._may_wait_on(tensors)

    def may_wait_in_forward(self, defer, trace_mode):
        """``may_wait`` of a forward hook before its tensors are known (``add_forward`` asks where
        they are)."""
        return defer and not trace_mode and graph_task_id() == -1 and not torch.is_inference_mode_enabled()

    def add_forward(self, entries_of, module, input, output, kwargs, outputs, kept, site):
        """A forward hook call outside torch.func transforms in the hook layer's one call
        (``hook_core.forward_call``): its entries, the hooks on its outputs' gradients (``outputs``),
        its kept call's output (``kept``) and its rows, which wait where ``site`` >= 0 (``may_wait``)
        allows. ``(entries, tensors, dtypes, sources)``, sources as ``add`` gives them (None: no tensors,
        or the buffer is full: then ``add`` them, with ``site_of``, once it was read)."""
        core = None if _IN_FLIGHT else self._core  # (an async collective writes some memory now: ``add``)
        entries, tensors, dtypes, sources, answer = self._forward_call(entries_of, module, input, output, kwargs, outputs,
                                                                       kept, core, site, self.waits_on_cpu)
        if sources is None and tensors:
            sources = self.add(tensors, self.site_of(tensors, site)) if answer is None else self.added(tensors, answer)
        return entries, tensors, dtypes, sources

    def site_of(self, tensors, site):
        """``site`` where ``tensors`` may wait on their device, else -1 (as ``add_forward`` decides)."""
        return site if site < 0 or self._may_wait_on(tensors) else -1

    def _may_wait_on(self, tensors):
        """Whether a call's tensors may wait where they are: off the CPU, or on it where its rows are
        not host memory (the accelerators' path run on CPU tensors)."""
        return self.waits_on_cpu or not tensors[0].is_cpu

    def add(self, tensors, site=-1):
        """Read ``tensors`` (a hook call's, at least one) now, or let them wait where ``site`` (the
        call site's id, with ``may_wait``) allows. Returns the call's sources for ``resolve``, or
        None when the buffer has no room: read and replay what is pending, ``reset``, add again."""
        if len(tensors) > self.capacity:
            return self.read_apart(tensors)
        if _IN_FLIGHT:  # an async collective writes some memory now
            tensors, site = _settled(tensors, site)
        return self.added(tensors, self._core.add(tensors, site, site >= 0))

    def added(self, tensors, answer):
        """The sources of ``tensors`` from the core's answer to their ``add`` (``add``'s result)."""
        key, rows, first, to_read, changed, read = answer
        if key < 0:
            if key == HOOK_FULL and len(tensors) <= self.capacity:
                return None
            return self.read_apart(tensors)  # several devices, or more tensors than the buffer holds
        if changed or (to_read and read != LAUNCHED):  # (not the common case: this runs at every hook)
            self._taken(key, first, to_read, changed, read)
        return key, rows, None

    def read(self):
        """Bring the rows added since the last read to the host (one copy per device, which waits
        for its work; CPU rows are written in host memory already); DTensor and ZeRO-3 rows are
        combined across ranks (one collective). True when a row counts a nan or an inf."""
        core = self._core
        for key, first, to_read, changed, read in core.pending():
            self._taken(key, first, to_read, changed, read)
        nonfinite = self._apart_nonfinite
        for key, buffer in self._buffers.items():
            # only the rows added since the last read: check="module" reads at every hook
            start = self._read_rows.get(key, 0)
            used = core.used(key)
            if used <= start:
                continue
            host, values = self._host_rows(key)
            shards = self._shards.get(key)
            if buffer is not host or shards:
                rows = buffer[start:used]
                if shards:
                    bad = {}
                    rows = distributed.global_rows(rows, [shards.get(row) for row in range(start, used)],
                                                   bad_shards=bad)
                    self._bad_shards.update(((key, start + row), ranks) for row, ranks in bad.items())
                host[start:used].copy_(rows.cpu())  # the host read: waits for the device's work
            self._read_rows[key] = used
            nonfinite = nonfinite or any(any(values[column + start * NUM_COLUMNS:used * NUM_COLUMNS:NUM_COLUMNS])
                                         for column in (NAN, POSINF, NEGINF))
        return nonfinite

    def resolve(self, frame, sources):
        """Set ``frame.rows`` from the call's ``sources`` (after ``read``), with the lines of rows
        that could not be read and of DTensor shards that hold a nan/inf."""
        key, rows, marks = sources
        if key is None:  # read apart: host rows already
            frame.rows = rows
            for index, (reason, ranks) in (marks or {}).items():
                if reason is not None:
                    frame.mark_unreadable(index, reason)
                if ranks is not None:
                    frame.mark_bad_shards(index, ranks)
            return
        values = self._host[key][1]
        frame.rows = [values[row * NUM_COLUMNS:(row + 1) * NUM_COLUMNS].tolist() for row in rows]
        if self._marks or self._bad_shards:
            for index, row in enumerate(rows):
                if (key, row) in self._marks:
                    frame.mark_unreadable(index, self._marks[key, row])
                if (key, row) in self._bad_shards:
                    frame.mark_bad_shards(index, self._bad_shards[key, row])

    def unchanged(self, sources, index, tensor):
        """Whether ``tensor`` is unchanged since the hook that read it as the ``index``-th tensor of a
        call (its ``sources``): True, False, or None where that cannot be told (a call read apart, reuse
        off, an inference tensor). Asked before ``reset``."""
        key, rows, _ = sources
        if key is None:
            return None
        answer = self._core.unchanged(tensor, key, rows[index])
        return None if answer < 0 else bool(answer)

    def reset(self):
        """Every row is free again; nothing is reused or held."""
        self._core.reset()
        self._read_rows.clear()
        self._marks.clear()
        self._shards.clear()
        self._bad_shards.clear()
        self._apart_nonfinite = False

    # -- internals --------------------------------------------------------------------------

    def _buffer(self, key):
        buffer = self._buffers.get(key)
        if buffer is None:
            device = self._core.device(key)
            if device.type in self._host_types:  # the kernel writes the host rows themselves
                buffer = self._host_rows(key)[0]
            else:
                buffer = torch.empty((self.capacity, NUM_COLUMNS), dtype=torch.int64, device=device)
            self._buffers[key] = buffer
            # from now on the core reads this device's tensors itself, in the hook's one call
            self._readers[key] = rows_reader(self.backend, device)
            launcher = rows_launcher(self.backend, device)
            if launcher is not None:
                self._core.bind(key, launcher, buffer)
                self._launchers[key] = launcher
        return buffer

    def _host_rows(self, key):
        host = self._host.get(key)
        if host is None:
            rows = torch.empty((self.capacity, NUM_COLUMNS), dtype=torch.int64)
            host = self._host[key] = (rows, host_bytes(rows).cast("q"))
        return host

    def _taken(self, key, first, to_read, changed, read):
        """The tensors the core handed out for rows [first, first + len) of a device's buffer: read
        here unless its launcher read them (``read``: hook_core's READ_BY_CALLER, LAUNCHED or
        LAUNCH_FAILED); ``changed``: the rows whose tensor changed after its hook."""
        if read == LAUNCH_FAILED:
            warnings.warn(f"overflow_fast: the per-hook read on {self._core.device(key)} failed "
                          f"({self._launchers[key].disabled}); the detector reads there through tensor_stats "
                          "from now on", RuntimeWarning, stacklevel=2)
        if to_read and read != LAUNCHED:
            self._launch(key, first, to_read)
        if changed:
            self._marks.update(((key, row), CHANGED_AFTER_HOOK) for row in changed)

    def _launch(self, key, first, tensors):
        """Enqueue the statistics of ``tensors`` into rows [first, first + len) of a device's buffer."""
        out = self._buffer(key)[first:first + len(tensors)]
        result = self._stats(tensors, out, key)
        if result is not None:  # the engine failed: the torch backend's rows, one tensor at a time
            rows, reasons = result
            out.copy_(torch.tensor(rows, dtype=torch.int64))
            self._marks.update(((key, first + index), reason) for index, reason in reasons.items())
        infos = _shard_infos(tensors)
        if infos is not None:
            shards = self._shards.setdefault(key, {})
            shards.update((first + index, info) for index, info in enumerate(infos) if info is not None)

    def read_apart(self, tensors):
        """Host rows now (one host read): the sources of a call read without the buffer (tensors
        on several devices, more tensors than the buffer holds, a call read on its own)."""
        try:
            rows = tensor_stats(tensors, self.backend).host_rows()
            reasons = {}
        except Exception as error:  # noqa: BLE001 - any engine failure falls back
            rows, reasons = self._one_at_a_time(tensors, error)
        marks = {index: (reason, None) for index, reason in reasons.items()}
        infos = _shard_infos(tensors)
        if infos is not None:
            bad = {}
            rows = distributed.global_rows(rows, infos, bad_shards=bad)
            for index, ranks in bad.items():
                marks[index] = (marks.get(index, (None, None))[0], ranks)
        return self.host(rows, marks or None)

    def host(self, rows, marks=None):
        """The sources of a call whose rows are on the host already (read apart, or a compiled
        graph's); ``marks``: {index: (unreadable reason or None, bad shard ranks or None)}."""
        if any(row[NAN] or row[POSINF] or row[NEGINF] for row in rows):
            self._apart_nonfinite = True
        return None, rows, marks

    def _stats(self, tensors, out, key):
        """The backend's per-hook read into ``out`` (the triton backend's one launch), else
        ``tensor_stats``; None when it worked, else the fallback's rows and reasons."""
        try:
            reader = self._readers[key]
            if reader is None or not reader(tensors, out):
                tensor_stats(tensors, self.backend, out=out)
            return None
        except Exception as error:  # noqa: BLE001
            return self._one_at_a_time(tensors, error)

    def _one_at_a_time(self, tensors, error):
        """After the engine failed on a call: warn once, then read each tensor with the torch
        backend, so that only a tensor nothing can read loses its line. ``(rows, {index: reason})``."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"overflow_fast: tensor_stats failed ({type(error).__name__}: {error}); the detector "
                          "reads such tensors one at a time with the 'torch' backend, with a host sync each",
                          RuntimeWarning, stacklevel=5)
        rows = []
        reasons = {}
        for index, tensor in enumerate(tensors):
            try:
                rows.append(tensor_stats([tensor], "torch").host_rows()[0])
            except Exception as failure:  # noqa: BLE001
                rows.append([0] * NUM_COLUMNS)
                reasons[index] = short_reason(f"{type(failure).__name__}: {failure}")
        return rows, reasons


_IN_FLIGHT = distributed.IN_FLIGHT


def _settled(tensors, site):
    """``(tensors, site)`` for the core while async collectives write: a tensor whose memory one
    writes now is read now as an alias of its own (another tensor object, the same memory and
    version counter), so no row read before the write is reused for it, and nothing read of it
    until its work completes is remembered; such a call is read in its hook, never later."""
    flying = distributed.in_flight(tensors)
    if not flying:
        return tensors, site
    tensors = list(tensors)
    for index in flying:
        tensors[index] = tensors[index].detach()
    return tensors, -1


def _shard_infos(tensors):
    """Per tensor, what combining the rows of a DTensor's shards (or a ZeRO-3 parameter's
    partitions) across ranks needs (None for other tensors), or None when there is no such tensor
    (the common case: one type check per tensor)."""
    zero3 = "deepspeed" in sys.modules  # a released ZeRO-3 parameter is a plain, empty tensor
    for tensor in tensors:  # a loop, not all(): this runs at every hook
        if type(tensor) not in PLAIN_TYPES or (zero3 and is_zero3_released(tensor)):
            break
    else:
        return None
    infos = [distributed.shard_info(t) for t in tensors]
    return infos if any(info is not None for info in infos) else None
