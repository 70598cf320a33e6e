"""Collectives as the detector must see them: the writes of in-place collectives, and a guard that
stops every collective before it runs.

Writes. ``dist.all_reduce(h)``, ``broadcast``, ``reduce``, ``recv``, ``all_to_all_single``, the
outputs of ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (async or not, under their
legacy names too) write their tensors without bumping the version counter, so a row read before
the write would pass for the tensor after it. While :func:`seen_as_writes` is held (a detector
holds it while its hooks are on), a kernel on each in-place collective op bumps the version counter
of every tensor the op writes, as torch's own in-place ops do; the detector's checks of "unchanged"
(reused rows, deferred reads, find_op's kept inputs) then see the write. The kernel sits in torch's
dispatcher at ``ADInplaceOrView``, where torch bumps versions for its own in-place ops, so it
serves every caller: ``dist.all_reduce``, a function imported before the detector existed, a
``ProcessGroup`` method, DDP's reducer, FSDP. It costs other ops nothing and a collective one Python
call (registered once, when the first detector's pass begins under a process group; after the
last detector is removed it only passes the call on).
Inference tensors have no version counter (and no reuse) and never reach it. As for any
in-place op, a backward that needs a tensor a collective overwrote after autograd saved it raises
torch's "modified by an inplace operation" error, where without the detector it would silently
use the overwritten values.

Async. A collective's op returns once its work is queued (``dist.all_reduce(h, async_op=True)``,
DDP's buckets, every op under ``dist``'s synchronous call too, which waits right after): what it
writes counts as written when its work completes (``wait()``, or on an accelerator the stream
synchronizing), not when the op returns. The bump comes when it returns, so that nothing read
before is reused after; until its work completes, the storage it writes is in flight
(:func:`in_flight`, asked by the detector's reads at each hook): a tensor there is read afresh at
every hook, and nothing read of it then is reused, so a row read before the work wrote it never
stands for the tensor after the write, waited at once or later.

No communication. Inside ``with NoCommunication() as guard:`` on a thread (find_op's replays
enter it, and enter the same guard on autograd's threads), every collective raises
:class:`CommunicationRefused` before it sends anything, and ``guard.refused`` keeps the first one
refused, even if the code that called it caught the error. The ops stopped: every op of
``c10d`` (what ``torch.distributed`` calls), the functional collectives (DTensor's redistribution),
``_dtensor`` and ``symm_mem``; the kernel covers ops called from within a tensor subclass's dispatch,
``communicating(func)`` lets a dispatch mode stop the rest before it runs them.
"""

import functools
import sys
import threading
import warnings
import weakref

import torch

# namespaces whose ops communicate across ranks, and their ops that do not
_COMMUNICATING = {"c10d": {"check_for_nan"}, "_c10d_functional": {"wait_tensor"},
                  "c10d_functional": {"wait_tensor"}, "_c10d_functional_autograd": set(),
                  "_dtensor": {"mesh_get_process_group"}, "symm_mem": set()}
# c10d's in-place ops carry no alias annotation in their schema: every op whose name ends with "_"
# writes its first argument (a tensor, a list, or a list of lists), but these
_C10D_NOT_WRITING = {"monitored_barrier_"}

_KEY = "ADInplaceOrView"
_local = threading.local()
_lock = threading.Lock()


class CommunicationRefused(Exception):
    """A collective that a :class:`NoCommunication` guard stopped before it ran (``op``: its name)."""

    def __init__(self, op):
        self.op = op
        super().__init__(f"the call communicates across ranks: {op}")


def _short(qualified):
    """``c10d::allreduce_`` -> ``c10d.allreduce_``."""
    return qualified.replace("::", ".")


def communicating(func):
    """The name of an op that communicates across ranks (``c10d.allreduce_``), else None."""
    namespace = getattr(func, "namespace", None)
    quiet = _COMMUNICATING.get(namespace)
    if quiet is None:
        return None
    name = func._schema.name.split("::", 1)[-1]  # without the overload
    return None if name in quiet else f"{namespace}.{name}"


@functools.lru_cache(maxsize=1)
def _ops():
    """``{qualified name: written}`` of every communicating op torch has registered (libtorch
    registers them when it loads), where ``written(args, kwargs)`` gives the tensors it writes
    (None: it writes none)."""
    try:
        names = torch._C._dispatch_get_all_op_names()
    except AttributeError:
        return {}
    found = {}
    for qualified in names:
        namespace, _, name = qualified.partition("::")
        name = name.partition(".")[0]  # without the overload
        quiet = _COMMUNICATING.get(namespace)
        if quiet is None or name in quiet:
            continue
        if namespace == "c10d":
            found[qualified] = _first_argument if name.endswith("_") and name not in _C10D_NOT_WRITING else None
        else:
            found[qualified] = _annotated_writes(qualified)
    return found


def _first_argument(args, kwargs):
    return _tensors(args[0]) if args else []


def _annotated_writes(qualified):
    try:
        name, _, overload = qualified.partition(".")
        arguments = torch._C._dispatch_find_schema_or_throw(name, overload).schema().arguments
    except RuntimeError:
        return None
    written = [(index, argument.name) for index, argument in enumerate(arguments)
               if argument.alias_info is not None and argument.alias_info.is_write]
    if not written:
        return None

    def writes(args, kwargs):
        tensors = []
        for index, name in written:
            value = args[index] if index < len(args) else kwargs.get(name)
            tensors.extend(_tensors(value))
        return tensors

    return writes


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _bump(tensors):
    """Bump the version counter of each tensor that has one (inference tensors have none)."""
    for tensor in tensors:
        if not tensor.is_inference():
            torch.autograd.graph.increment_version(tensor)


# The storage of each tensor an async collective writes -> its work, until that work completes.
# One dict, never rebound: the detector's reads test it at every hook (empty: nothing in flight).
IN_FLIGHT = {}
_flight_lock = threading.Lock()


def _storage(tensor):
    """Which memory a tensor is in (its views share it), or None where it has none of its own."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _work_of(result):
    """The ``Work`` an op returned (c10d's ops return one beside their tensors), or None."""
    for item in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(item, torch.ScriptObject):
            try:
                return torch._C._distributed_c10d.Work.unbox(item)
            except (RuntimeError, TypeError, AttributeError):
                continue
    return None


def _done(work):
    try:
        return work.is_completed()
    except Exception:  # noqa: BLE001 - a work that failed writes nothing more
        return True


def _forget_done():
    """Drop the works that completed (with the lock held)."""
    for key in [key for key, work in IN_FLIGHT.items() if _done(work)]:
        del IN_FLIGHT[key]


def _fly(tensors, result):
    """The tensors an op wrote are in flight until the work it returned completes."""
    work = _work_of(result)
    if work is None or _done(work):
        return  # (the functional collectives' in-place ops complete at wait_tensor: the bump stands)
    keys = [key for key in map(_storage, tensors) if key is not None]
    with _flight_lock:
        _forget_done()
        for key in keys:
            IN_FLIGHT[key] = work


def in_flight(tensors):
    """The positions in ``tensors`` of those whose memory an async collective writes now, its work
    not completed yet (those whose work completed are forgotten). Called only while ``IN_FLIGHT``
    holds something."""
    with _flight_lock:
        _forget_done()
        if not IN_FLIGHT:
            return []
        return [index for index, tensor in enumerate(tensors) if _storage(tensor) in IN_FLIGHT]


def _kernel(qualified, written):
    """The kernel of one op: the guard's check, the op itself, then (while a detector holds
    ``seen_as_writes``) the bump of what it wrote."""
    namespace, _, name = qualified.partition("::")
    name, _, overload_name = name.partition(".")
    overload = getattr(getattr(getattr(torch.ops, namespace), name), overload_name or "default")
    below = torch._C._after_ADInplaceOrView_keyset
    short = _short(qualified)

    def kernel(keyset, *args, **kwargs):
        guard = _current()
        if guard is not None:
            guard.refuse(short, _tensors(list(args)) + _tensors(list(kwargs.values())))
        if written is None:
            return overload.redispatch(keyset & below, *args, **kwargs)
        result = None
        try:
            result = overload.redispatch(keyset & below, *args, **kwargs)
            return result
        finally:
            if _holders:
                tensors = written(args, kwargs)
                _bump(tensors)  # also after a failure: some of it may have been written
                if result is not None:
                    _fly(tensors, result)

    return kernel


# The kernels stay registered once registered: taking a kernel out of torch's dispatcher while
# another thread runs it frees it under that call. Without a holder they only pass the call on.
_holders = weakref.WeakSet()  # the live WritesSeen (a detector's, or collected: gone by itself)
_registered = {}  # in_place (True/False) -> the torch.library.Library objects, or None (failed)


def _register(in_place):
    """Register the kernels of the in-place ops (or of the others) once per process; a failure
    warns once and the training goes on."""
    with _lock:
        if in_place in _registered:
            return
        try:
            _registered[in_place] = _library(in_place)
        except Exception as error:  # noqa: BLE001 - a torch without these APIs must not stop training
            _registered[in_place] = None
            warnings.warn(f"overflow_fast: cannot register the kernels that make in-place collectives count as "
                          f"writes ({type(error).__name__}: {error}); a row read before dist.all_reduce(h) and "
                          "the like may be reused after it (reuse_stats=False avoids that), and find_op's "
                          "replays stop only the collectives their own dispatch mode sees", RuntimeWarning,
                          stacklevel=4)


def _library(in_place):
    """A ``torch.library`` registration of the kernels of the in-place ops (or of the others)."""
    libraries = []
    try:
        by_namespace = {}
        for qualified, written in _ops().items():
            if (written is not None) != in_place:
                continue
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, _KEY):
                continue  # an op that has its own (torch.library.custom_op bumps versions itself)
            namespace, _, name = qualified.partition("::")
            library = by_namespace.get(namespace)
            if library is None:
                library = by_namespace[namespace] = torch.library.Library(namespace, "IMPL")
                libraries.append(library)
            library.impl(name, _kernel(qualified, written), _KEY, with_keyset=True)
    except BaseException:
        for library in libraries:  # nothing half-registered stays (no call can be in it yet)
            library._destroy()
        raise
    return libraries


def _available():
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available()


def _initialized():
    import torch.distributed as dist

    return _available() and dist.is_initialized()


class WritesSeen:
    """What :func:`seen_as_writes` returns: ``release()`` it (or let it be collected) when done."""

    def __init__(self):
        _register(in_place=True)
        _holders.add(self)

    def release(self):
        _holders.discard(self)
        if not _holders:
            with _flight_lock:
                IN_FLIGHT.clear()  # (nothing asks any more: keep no work, nor what it writes)


def seen_as_writes():
    """In-place collectives bump the version counters of the tensors they write until the result's
    ``release()`` (or its collection); None while no process group exists (no collective can run:
    ask again later) and where torch has no distributed support."""
    return WritesSeen() if _initialized() else None


def _current():
    stack = getattr(_local, "guards", None)
    return stack[-1] if stack else None


def active_guard():
    """The :class:`NoCommunication` guard active on this thread, or None."""
    return _current()


class NoCommunication:
    """``with guard:`` on a thread: every collective there raises :class:`CommunicationRefused`
    before it runs; ``refused`` is the first one's name. The same guard may be entered on several
    threads (autograd's) and re-entered."""

    def __init__(self):
        self.refused = None
        self.frames = []  # where the first refused one was called: (file, line, function), innermost first
        # called with (op, its tensor arguments) at the first refusal; what it returns is ``note``
        self.on_refuse = None
        self.note = None

    def refuse(self, op, tensors=()):
        """Stop ``op`` (its tensor arguments: ``tensors``): note the first one, raise
        :class:`CommunicationRefused`."""
        if self.refused is None:
            self.refused = op
            frame = sys._getframe(1)
            while frame is not None:
                self.frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
                frame = frame.f_back
            if self.on_refuse is not None:
                self.note = self.on_refuse(op, list(tensors))
        raise CommunicationRefused(op)

    def __enter__(self):
        if _initialized():  # without a process group no collective can run
            _register(in_place=True)
            _register(in_place=False)
        stack = getattr(_local, "guards", None)
        if stack is None:
            stack = _local.guards = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _local.guards.pop()
        return False
