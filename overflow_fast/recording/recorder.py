"""The JSONL flight recorder: per-tensor statistics records written off the training thread.

One JSON object per line, strict JSON (non-finite floats are the strings ``"nan"``, ``"inf"`` and
``"-inf"``, so ``json.loads(line, parse_constant=<raise>)`` accepts every line):

- first line, ``{"record": "meta", "version": 1, "rank", "world_size", "started", "pid", "torch"}``;
- one ``"entry"`` record per tensor entry of every frame (``entry_record``);
- one ``"detection"`` record when a nan/inf is detected (``detection_record``);
- one ``"backoff"`` record when a GradScaler backs off (``backoff_record``).

Entry and detection records end with ``"global_step"`` and ``"mode"`` (the trainer's optimizer
step, "train" or "eval") when they are known, and leave them out when not (no bytes spent on nulls
in a loop that never names its steps).

The fields of each kind are defined once, in ``schema.py``, which the report's readers check every
line against.

One writer per file: a recorder holds an advisory lock (``flock``) on its file until it is closed
or its process dies; a second recorder on a file being written, in this process or another, is
refused with ``LogInUse`` before it truncates anything.

Streams: ``log=`` may also be a FIFO, a terminal or another character device, or a descriptor of
this process by name (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``).
- Opening never blocks: a FIFO that no process is reading is refused at once (``OSError`` naming
  it and why). After the open, writes block: a full pipe makes the writer thread wait for its
  reader (backpressure, as ``print`` does; ``flush()``, ``close()`` and a normal exit wait with
  it), it never drops records. A descriptor by name is the
  process's own stream (``os.dup``): its offset, its flags (a non-blocking one is waited on with
  ``poll``), shared with the process's own prints.
- A stream is never truncated and never seeked, and keeps its name under several ranks (they all
  write to it; every record carries its rank).
- It is shared by design, so it takes no lock: any number of recorders, in this process or others,
  may write one FIFO, terminal or ``/dev/stdout``. Except where the descriptor is a regular file
  (stdout redirected to a file): it takes a shared lock there, so that all of the process's
  recorders on it go together, while a recorder of that file by its name (which truncates it) is
  refused with ``LogInUse``, and the other way round.
- Lines stay whole: a regular file gets one ``write(2)`` per batch, and a failed one is cut back to
  where the batch began. A stream gets whole lines, at most ``PIPE_BUF`` bytes per ``write(2)``
  where the lines allow: POSIX makes such a write to a pipe atomic, so the lines of several writers
  (another recorder, the process's own prints) never interleave. A single line longer than
  ``PIPE_BUF`` goes in one write of its own, which the kernel may split and interleave with another
  writer's output (no more can be had on a pipe). A stream cannot be cut back: a failed write
  can leave a partial last line there, and nothing more is written after it.

``Recorder.write(records)`` only enqueues: a daemon thread encodes and writes, so no partial line
is ever on disk. Everything enqueued is written by ``flush()``, ``close()``, at normal interpreter
exit and on SIGTERM (on SIGTERM for as long as the writer makes progress: one stalled for
``STALL_SECONDS``, a pipe nobody reads, is given up on with a warning, and the process dies as
SIGTERM asks); a write error warns once and drops records (training goes on).
"""

import atexit
import collections
import datetime
import errno
import json
import math
import os
import re
import select
import signal
import stat
import threading
import time
import warnings
import weakref

from typing import Any, Dict, List, Optional, Union

import torch

from . import schema
from .schema import TENSOR
from ..stats.layout import decode_row, is_integer_dtype

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here; one writer per file is then up to the user
    fcntl = None  # type: ignore[assignment]

VERSION = schema.VERSION
PHASES = schema.PHASES

_NONFINITE = set(schema.NONFINITE)
_META_KEYS = schema.KEYS["meta"]
_ENTRY_KEYS = tuple(k for k in schema.KEYS["entry"] if k not in schema.WHEN_KNOWN)
_DETECTION_KEYS = tuple(k for k in schema.KEYS["detection"] if k not in schema.WHEN_KNOWN and k != "where")
_BACKOFF_KEYS = tuple(k for k in schema.KEYS["backoff"] if k not in schema.WHEN_KNOWN)


# -- records ------------------------------------------------------------------------------------

def encode_float(value):
    """A float as strict JSON takes it: finite floats as they are, non-finite as a string."""
    if value is None:
        return None
    value = float(value)
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def decode_float(value):
    """The inverse of ``encode_float`` for a reader: ``"nan"``/``"inf"``/``"-inf"`` -> float."""
    if isinstance(value, str):
        if value in _NONFINITE:
            return float(value)
        raise ValueError(f"not a number: {value!r}")
    return value


def dtype_name(dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (strings are passed through)."""
    name = str(dtype)
    return name[6:] if name.startswith("torch.") else name


def meta_record(rank=None, world_size=None, check=None):
    return dict(zip(_META_KEYS, (
        "meta", VERSION, rank, world_size, datetime.datetime.now(datetime.timezone.utc).isoformat(),
        os.getpid(), torch.__version__, check,
    )))


def _when_known(record, global_step, mode, computed_in=None):
    if global_step is not None:
        record["global_step"] = int(global_step)
    if mode is not None:
        record["mode"] = mode
    if computed_in is not None:
        record["computed_in"] = dtype_name(computed_in)
    return record


def entry_record(step, phase, call, module, class_name, ctx, dtype, row, rank=None, global_step=None, mode=None,
                 computed_in=None):
    """One tensor entry's record from its raw statistics row (8 ints, ``stats.layout``).
    ``step`` is the detector's batch number; ``global_step`` and ``mode`` the trainer's optimizer
    step and "train"/"eval", written when known (not None).

    Integer dtypes keep their exact magnitudes (up to 2**64 - 1) as JSON integers; float, bool
    and complex magnitudes are floats (non-finite ones encoded as strings); an empty tensor has
    ``abs_min``/``abs_max`` null and fractions 0.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    stats = decode_row([int(v) for v in row], dtype)
    numel = stats["numel"]
    if stats["abs_min"] is None or is_integer_dtype(dtype):
        abs_min, abs_max = stats["abs_min"], stats["abs_max"]
    else:
        abs_min, abs_max = encode_float(stats["abs_min"]), encode_float(stats["abs_max"])
    return _when_known(dict(zip(_ENTRY_KEYS, (
        "entry", int(step), phase, int(call), module, class_name, ctx, dtype_name(dtype), numel,
        abs_min, abs_max, stats["nan"], stats["posinf"], stats["neginf"],
        stats["zero"] / numel if numel else 0.0, stats["subnormal"] / numel if numel else 0.0, rank,
    ))), global_step, mode, computed_in)


def frame_records(step, phase, call, frame, rank=None, global_step=None, mode=None):
    """The entry records of one frame (``schema.RecordedFrame``, its ``rows`` on the host): one per tensor
    entry (``None``, non-tensor and unreadable entries have no statistics and no record)."""
    return [
        entry_record(step, phase, call, frame.module_name, frame.class_name, ctx,
                     frame.dtypes[payload], frame.rows[payload], rank, global_step, mode, frame.computed_in)
        for kind, ctx, payload in frame.entries
        if kind == TENSOR
    ]


def detection_record(step, phase, module, class_name, entries, rank=None, global_step=None, mode=None):
    return _when_known(dict(zip(_DETECTION_KEYS, ("detection", int(step), phase, module, class_name, list(entries),
                                                  rank))), global_step, mode)


def backoff_record(step, module, class_name, entries, scale, in_a_row, rank=None, global_step=None, mode=None):
    return _when_known(dict(zip(_BACKOFF_KEYS, ("backoff", int(step), module, class_name, list(entries),
                                                encode_float(scale), int(in_a_row), rank))), global_step, mode)


def _strict(value):
    """``value`` with every non-finite float replaced by its string (for records built elsewhere)."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def _default(value):
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _strict(value.item())
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _strict(item())
        except Exception:
            pass
    return str(value)


def encode_line(record) -> bytes:
    """One record as one line of strict JSON (UTF-8, ending with a newline)."""
    try:
        text = json.dumps(record, separators=(",", ":"), allow_nan=False, default=_default)
    except ValueError:  # a non-finite float somewhere
        text = json.dumps(_strict(record), separators=(",", ":"), allow_nan=False, default=_default)
    return (text + "\n").encode("utf-8")


# -- file naming ----------------------------------------------------------------------------------

def _distributed_rank():
    """(rank, world_size) under torch.distributed, else from the launcher's environment
    (torchrun sets RANK/WORLD_SIZE before init_process_group), else (None, None)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        pass
    return None, None


def rank_path(path, rank=None, world_size=None) -> str:
    """The file of one rank: ``{rank}`` in the path is replaced by the rank (0 without one);
    otherwise with a world size above 1 the rank goes before the suffix
    (``run.jsonl`` -> ``run.rank1.jsonl``), except for a stream (``is_stream``), which the ranks
    share under its own name (``/dev/stdout.rank1`` would be a new file in ``/dev``)."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank if rank is not None else 0))
    if world_size is not None and world_size > 1 and rank is not None and not is_stream(path):
        directory, name = os.path.split(path)
        stem, dot, suffix = name.rpartition(".")
        name = f"{stem}.rank{rank}.{suffix}" if dot and stem else f"{name}.rank{rank}"
        return os.path.join(directory, name)
    return path


_STD_NAMES = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}


def descriptor_named(path):
    """The file descriptor of this process that ``path`` names, or None: ``/dev/stdout`` (and
    stdin, stderr), ``/dev/fd/N``, ``/proc/self/fd/N``, ``/proc/<this pid>/fd/N``, or a symbolic
    link to one of them. Such a path opened anew would not be the process's own stream (a regular
    file behind it would be opened at offset 0, a socket not at all)."""
    own = re.compile(rf"/(?:dev/fd|proc/(?:self|thread-self|{os.getpid()})/fd)/([0-9]+)")
    path = os.fspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        normal = os.path.normpath(os.path.abspath(path))
        if normal in _STD_NAMES:
            return _STD_NAMES[normal]
        match = own.fullmatch(normal)
        if match:
            return int(match.group(1))
        try:
            target = os.readlink(normal)
        except (OSError, ValueError):
            return None
        path = os.path.join(os.path.dirname(normal), target)
    return None


def is_stream(path) -> bool:
    """Whether ``path`` is written as a stream (see the module's docstring): a descriptor of this
    process by name, or an existing file that is neither regular nor a directory (a FIFO, a
    terminal, a device)."""
    if descriptor_named(path) is not None:
        return True
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


# -- one writer per file ----------------------------------------------------------------------------

class LogInUse(RuntimeError):
    """Another flight recorder, in this process or another, is writing this file."""


_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)  # a terminal as the log must not become the controlling one


def _refused(path, why, number=errno.EINVAL):
    return OSError(number, f"overflow_fast: the flight-recorder log {path} {why}")


def _lock(fd, path, how):
    """``flock`` ``fd`` without waiting; ``LogInUse`` when another recorder holds the file."""
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LogInUse(
                f"overflow_fast: the flight-recorder log {path} is already being written by another "
                f"recorder (in this process or another); give each one its own path "
                f"(one file per rank: put {{rank}} in the path)") from None
        warnings.warn(f"overflow_fast: cannot lock the flight-recorder log {path} ({error.strerror}); "
                      f"make sure no other recorder writes it", RuntimeWarning, stacklevel=4)


def _open_locked(path):
    """(the file descriptor to write, whether it is a regular file of this recorder's own), the
    file locked and truncated when it is one.

    A regular file: the lock comes first, then the truncation: a recorder refused must not have cut
    the file of the one writing it. The lock is an ``flock`` on the open file, so it conflicts
    within one process too, and goes away when the file is closed or the process dies (a crash
    leaves no stale lock). Anything else is a stream (see the module's docstring): opened without
    blocking (a FIFO with no reader is refused, not waited on), then written with blocking writes;
    never locked (but a regular file behind a descriptor, shared), never truncated."""
    number = descriptor_named(path)
    if number is not None:
        try:
            fd = os.dup(number)
        except OSError:
            raise _refused(path, f"names file descriptor {number} of this process, which is not open",
                           errno.EBADF) from None
    else:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | _O_NONBLOCK | _O_NOCTTY, 0o644)
        except OSError as error:
            raise _open_error(path, error) from None
        if _O_NONBLOCK:
            os.set_blocking(fd, True)  # only the open must not wait: a full pipe is waited on, never dropped
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISBLK(mode):
            raise _refused(path, "is a block device (a disk): give a file, a FIFO or a terminal")
        if number is not None and fcntl is not None and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise _refused(path, f"names file descriptor {number} of this process, which is open for reading only",
                           errno.EBADF)
        own_file = stat.S_ISREG(mode) and number is None
        if own_file:
            _lock(fd, path, fcntl.LOCK_EX if fcntl else 0)
            os.ftruncate(fd, 0)
        elif stat.S_ISREG(mode):
            _lock(fd, path, fcntl.LOCK_SH if fcntl else 0)
    except BaseException:
        os.close(fd)
        raise
    return fd, own_file


def _open_error(path, error):
    """The error of opening ``path``, said plainly where the system's words would puzzle."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if error.errno == errno.ENXIO and stat.S_ISFIFO(mode):
        return _refused(path, "is a FIFO that no process is reading (opening it would wait for one): "
                              "start its reader first, or give a file", errno.ENXIO)
    if error.errno == errno.ENXIO and stat.S_ISSOCK(mode):
        return _refused(path, "is a Unix socket, which cannot be opened as a file: connect to it and give "
                              "/dev/fd/N of the connection", errno.ENXIO)
    return _refused(path, f"cannot be opened for writing ({error.strerror or error})", error.errno or errno.EIO)


# -- the writer ------------------------------------------------------------------------------------

PIPE_BUF = getattr(select, "PIPE_BUF", 512)  # the largest write a pipe takes atomically (POSIX: at least 512)
STALL_SECONDS = 5.0  # on SIGTERM, how long a writer that makes no progress is waited for

_live: "weakref.WeakSet[Recorder]" = weakref.WeakSet()  # recorders to flush at exit and on SIGTERM
_live_lock = threading.RLock()  # re-entrant: the SIGTERM handler runs on the main thread
_previous_sigterm = None
_sigterm_installed = False


class Recorder:
    """A JSONL file written by a daemon thread.

    ``path``: the file (truncated), or a stream (a FIFO, a terminal, ``/dev/stdout``: see the
    module's docstring); see ``rank_path`` for one file per rank. A file another recorder is
    writing (this process or another) raises ``LogInUse``; a FIFO that no process is reading, an
    ``OSError`` at once. ``rank`` and
    ``world_size`` default to torch.distributed's (or RANK/WORLD_SIZE in the environment).
    ``log_every``: ``should_record(step)`` is true for every ``log_every``-th step.
    ``max_pending``: records waiting for the writer beyond which new ones are dropped (with one
    warning) rather than let a stalled disk grow the queue without bound.
    """

    def __init__(self, path: Union[str, os.PathLike], rank: Optional[int] = None, world_size: Optional[int] = None,
                 log_every: int = 1, max_pending: int = 1_000_000, check: Optional[str] = None) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive int, got {log_every!r}")
        if rank is None and world_size is None:
            rank, world_size = _distributed_rank()
        self.rank = rank
        self.world_size = world_size
        self.log_every = log_every
        self.path = rank_path(path, rank, world_size)
        directory = os.path.dirname(self.path)
        if directory and not os.path.isdir(directory):  # a typo in a path makes no folders
            raise FileNotFoundError(f"overflow_fast: cannot write the log {self.path}: its folder {directory} does not "
                                    "exist (create it first)")
        self._fd, self._own_file = _open_locked(self.path)
        self._pid = os.getpid()
        self._pending: collections.deque = collections.deque()  # (sequence number, [records])
        self._seq = 0  # last sequence number enqueued
        self._queued = 0  # records enqueued and not yet written
        self.max_pending = max_pending
        self._done = 0  # last sequence number written (or dropped)
        self._lock = threading.RLock()  # guards _seq, _queued and the order of _pending (re-entrant: SIGTERM)
        self._io_lock = threading.RLock()  # one drain at a time (RLock: a signal handler may re-enter)
        self._done_cond = threading.Condition(threading.Lock())
        self._wake = threading.Event()
        self._closed = False
        self._stopping = False
        self._broken = False
        self._warned_closed = False
        self._drainer = None  # the thread inside _drain
        self._progress = 0  # records encoded and writes done so far: how SIGTERM tells a slow writer from a stalled one
        self.write([meta_record(rank, world_size, check)])
        self._thread = threading.Thread(target=self._run, name="overflow_fast-recorder", daemon=True)
        self._thread.start()
        with _live_lock:
            _live.add(self)
        _install_sigterm_handler()

    # -- API used by the detector --

    def should_record(self, step: int) -> bool:
        return step % self.log_every == 0

    def write(self, records: List[Dict[str, Any]]) -> None:
        """Enqueue a list of record dicts; returns at once (encoding and I/O on the writer thread)."""
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): not this file's writer
            return
        if self._closed or self._broken:
            if self._closed and not self._warned_closed:
                self._warned_closed = True
                warnings.warn(f"overflow_fast: the flight recorder {self.path} is closed; records are dropped",
                              RuntimeWarning, stacklevel=2)
            return
        if not records:
            return
        with self._lock:
            if self._queued + len(records) > self.max_pending:
                overflow = True
            else:
                overflow = False
                self._queued += len(records)
                self._seq += 1
                self._pending.append((self._seq, records))
        if overflow:
            self._warn(f"{self.path} has {self._queued} records waiting for a slow disk; "
                       f"records are dropped until it catches up", "full")
            return
        self._wake.set()

    def flush(self, fsync: bool = False, timeout: Optional[float] = None) -> None:
        """Block until every record enqueued so far is in the file (os.fsync with ``fsync=True``)."""
        if os.getpid() != self._pid:
            return
        target = self._seq
        deadline = None if timeout is None else _now() + timeout
        self._wake.set()
        with self._done_cond:
            while self._done < target and not self._broken:
                if not self._thread.is_alive():
                    break
                remaining = 0.1 if deadline is None else min(0.1, deadline - _now())
                if remaining <= 0:
                    break
                self._done_cond.wait(remaining)
        if self._done < target:  # the writer is gone (interpreter shutdown) or slow: write here
            self._drain(notify=False)
        if fsync and not self._broken and self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError:
                pass

    def close(self) -> None:
        """Write everything enqueued, stop the writer thread and close the file. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            return
        self.flush()
        self._closed = True
        self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._io_lock:
            self._drain(notify=False)
            self._close_fd()
        with _live_lock:
            _live.discard(self)

    def _close_fd(self):
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    def __del__(self):
        try:
            if not self._closed and self._fd is not None and os.getpid() == self._pid:
                self.close()
        except Exception:
            pass

    # -- the writer thread --

    def _run(self):
        while True:
            self._wake.wait()
            self._wake.clear()
            self._drain()
            if self._stopping and not self._pending:
                return

    def _drain(self, notify=True):
        """Encode and write every pending batch: complete lines only (see ``_write_all``)."""
        with self._io_lock:
            outer, self._drainer = self._drainer, threading.get_ident()
            try:
                batches = []
                while True:
                    try:
                        batches.append(self._pending.popleft())
                    except IndexError:
                        break
                if not batches:
                    return
                last = batches[-1][0]
                count = sum(len(records) for _, records in batches)
                with self._lock:
                    self._queued -= count
                if not self._broken:
                    lines = []
                    for _, records in batches:
                        for record in records:
                            try:
                                lines.append(encode_line(record))
                            except Exception as error:  # a record that cannot be encoded: drop it, keep going
                                self._warn(f"could not encode a record ({error!r}); it is dropped", once_key="encode")
                            self._progress += 1
                    if lines:
                        self._write_all(b"".join(lines))
                self._done = max(self._done, last)
            finally:
                self._drainer = outer
        if notify:
            with self._done_cond:
                self._done_cond.notify_all()

    def _write_all(self, data):
        fd = self._fd
        if fd is None:
            self._fail(ValueError("the file is closed"))
            return
        if self._own_file:
            self._write_file(fd, data)
        else:
            self._write_stream(fd, data)

    def _write_file(self, fd, data):
        """One regular file of this recorder's: the batch in one write; a failed write is cut back to
        where the batch began (never a partial line)."""
        try:
            start = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError as error:
            self._fail(error)
            return
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                n = os.write(fd, view[written:])
                if n <= 0:
                    raise OSError("write returned 0")
                written += n
                self._progress += 1
        except OSError as error:
            if written:
                try:
                    os.ftruncate(fd, start)
                    os.lseek(fd, start, os.SEEK_SET)
                except OSError:
                    pass
            self._fail(error)

    def _write_stream(self, fd, data):
        """A stream (a pipe, a terminal, a socket, a descriptor shared with the process): never
        seeked. Whole lines, at most PIPE_BUF bytes per write where the lines allow (atomic on a
        pipe: never interleaved with another writer's); a descriptor its owner made non-blocking is
        waited on until it takes more, never given up on."""
        view = memoryview(data)
        try:
            for begin, end in whole_line_pieces(data, PIPE_BUF):
                piece = view[begin:end]
                while piece:
                    try:
                        n = os.write(fd, piece)
                    except BlockingIOError:
                        _wait_writable(fd)
                        continue
                    if n <= 0:
                        raise OSError("write returned 0")
                    piece = piece[n:]
                    self._progress += 1
        except OSError as error:
            self._fail(error)

    def _fail(self, error):
        self._broken = True
        self._warn(f"could not write to {self.path} ({error}); records are dropped from now on", "io")

    _warned = ()

    def _warn(self, message, once_key):
        if once_key in self._warned:
            return
        self._warned = self._warned + (once_key,)
        try:
            warnings.warn(f"overflow_fast: the flight recorder {message}", RuntimeWarning, stacklevel=2)
        except Exception:
            pass

    def _flush_before_dying(self):
        """On SIGTERM: everything enqueued written by the writer thread, for as long as it makes
        progress; one that makes none for ``STALL_SECONDS`` (a pipe nobody reads) is given up on,
        saying so, so that SIGTERM still ends the process."""
        if os.getpid() != self._pid or self._closed or self._broken:
            return
        if self._drainer == threading.get_ident():
            # this thread was inside a write when the signal came: writing more now would cut its line
            if self._done < self._seq:
                self._warn_stalled()
            return
        if not self._thread.is_alive():
            self._drain(notify=False)
            return
        target = self._seq
        self._wake.set()
        progress, since = self._progress, _now()
        while self._done < target and not self._broken:
            if self._progress != progress:
                progress, since = self._progress, _now()
            elif _now() - since >= STALL_SECONDS:
                self._warn_stalled()
                return
            time.sleep(0.005)

    def _warn_stalled(self):
        why = ("is not being read" if not self._own_file
               else f"took no write for {STALL_SECONDS:g} s")
        self._warn(f"log {self.path} {why}: records still queued are dropped", "stalled")


def whole_line_pieces(data, limit):
    """(begin, end) of consecutive pieces of ``data`` (complete lines) that end at line ends and
    hold at most ``limit`` bytes, except a line longer than ``limit``: a piece of its own."""
    begin, size = 0, len(data)
    while begin < size:
        if size - begin <= limit:
            yield begin, size
            return
        cut = data.rfind(b"\n", begin, begin + limit)
        if cut < 0:  # one line longer than the limit
            cut = data.find(b"\n", begin + limit)
            if cut < 0:
                cut = size - 1
        yield begin, cut + 1
        begin = cut + 1


def _wait_writable(fd):
    """Until ``fd`` (non-blocking) takes more bytes (or fails: the write that follows says how)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        poller.poll()
    else:
        select.select([], [fd], [fd])


def _now():
    return time.monotonic()


def _flush_all():
    with _live_lock:
        recorders = list(_live)
    for recorder in recorders:
        try:
            recorder._flush_before_dying()
        except Exception:
            pass


@atexit.register
def _close_all_at_exit():
    with _live_lock:
        recorders = list(_live)
    for recorder in recorders:
        try:
            recorder.close()
        except Exception:
            pass


def _on_sigterm(signum, frame):
    _flush_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or a handler not installed from Python): die of SIGTERM as before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_sigterm_handler():
    """Flush every recorder on SIGTERM, then behave as the handler before ours did. Only the main
    thread may install a handler; elsewhere there is none (atexit still flushes a normal exit)."""
    global _previous_sigterm, _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, AttributeError):  # no signals here (embedded interpreter, Windows quirks)
        return
    _previous_sigterm = previous
    _sigterm_installed = True


def _after_fork_in_child():
    # The writer thread does not exist in a forked child, and the parent's pending records are the
    # parent's to write: the child's recorders drop everything (the pid checks). A lock another
    # thread held at the fork would stay locked here: start with a fresh one.
    global _live_lock
    _live_lock = threading.RLock()
    # The child's copies of the recorders' files share the parent's lock: close them here, so the
    # lock goes when the parent closes its recorder, not when the last worker exits (only in the
    # instant before a new child runs this does it still hold it).
    for recorder in list(_live):
        recorder._close_fd()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = [
    "Recorder", "LogInUse", "entry_record", "frame_records", "detection_record", "meta_record", "encode_line",
    "encode_float", "decode_float", "dtype_name", "rank_path", "PHASES", "VERSION",
]
