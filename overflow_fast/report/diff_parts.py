"""``overflow-fast diff`` on large plain logs, in parts: their steps cut into ranges of about the
same size, each range compared in a process (the same ``Diff`` on the lines of those steps), the
parts merged in order. It gives the very diff that one pass gives.

A cut is a step: in each log, the part ends where the first entry of that step begins (found by
bisection over byte offsets, as the logs are in step order). There are a few parts per process,
each process taking the next part as it finishes one: a part's cost is not its size (where the logs
part, every pair is compared), so equal parts, one per process, would leave processes waiting. A
part that meets a record outside its steps (logs not in step order there: several ranks' records
interleaved, say) stops, and the logs are compared whole, in one pass. Compressed logs, streams and
small logs are compared in one pass.
"""

import os
import pickle
import selectors
import struct
import subprocess
import sys

from ..recording import schema
from . import logscan
from .diff import Diff, OutOfRange
from .entries import EntryReader, entry_at
from .summary import BadFile, LogFile

MIN_PART_BYTES = 32 << 20  # below this a part costs more to start than it saves
MAX_JOBS = 8
PARTS_PER_JOB = 4


def default_jobs():
    try:
        return max(1, min(len(os.sched_getaffinity(0)), MAX_JOBS))
    except AttributeError:  # no affinity here
        return max(1, min(os.cpu_count() or 1, MAX_JOBS))


def diff_logs(path_a, path_b, options, jobs=None, min_part_bytes=MIN_PART_BYTES):
    """The finished ``Diff(**options)`` of two logs: in parts when they are plain files big
    enough for more than one, read by ``jobs`` processes (default one per CPU, at most 8)."""
    jobs = default_jobs() if jobs is None else jobs
    logscan.native()  # built here, if need be, before any process would build it too
    parts = plan(path_a, path_b, jobs * PARTS_PER_JOB, min_part_bytes) if jobs > 1 else None
    failed = None
    if parts is not None:
        try:
            diff = _in_parts(path_a, path_b, options, parts, jobs)
        except OutOfRange:
            diff = None
        except PartFailed as error:  # a child that died (out of memory, killed): one pass still can
            diff, failed = None, str(error)
        if diff is not None:
            diff.finish()
            diff.parts = len(parts)
            return diff
    diff = Diff(**options)
    diff.run(EntryReader(path_a), EntryReader(path_b))
    diff.finish()
    diff.part_failed = failed
    return diff


class PartFailed(RuntimeError):
    """A part's process ended without its diff."""


def _in_parts(path_a, path_b, options, parts, jobs):
    """The parts' diffs, merged in order: each part read by one of ``jobs`` child processes, the
    next part handed to the first one that is done."""
    children = [_start(path_a, path_b, options) for _ in range(min(jobs, len(parts)))]
    results = [None] * len(parts)
    try:
        with selectors.DefaultSelector() as selector:
            ahead = iter(range(len(parts)))
            for child in children:
                index = next(ahead)
                _send(child, parts[index])
                selector.register(child.stdout, selectors.EVENT_READ, (child, index))
            while selector.get_map():  # a child is registered while it reads a part
                for key, _ in selector.select():
                    child, index = key.data
                    results[index] = _result(child)
                    selector.unregister(child.stdout)
                    index = next(ahead, None)
                    if index is not None:
                        _send(child, parts[index])
                        selector.register(child.stdout, selectors.EVENT_READ, (child, index))
    finally:
        for child in children:
            try:
                child.stdin.close()  # the end of its parts: it exits
            except OSError:
                pass
            if child.poll() is None and any(result is None for result in results):
                child.kill()
            child.wait()
            child.stdout.close()
    diff = results[0]
    for later in results[1:]:
        diff.merge(later)
    return diff


# a child is this Python, importing this package from where this process found it (not a fork: a
# fork of a process with threads may hang; not multiprocessing's spawn, which runs the caller's
# script again in the child when it lacks a __main__ guard)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(path_a, path_b, options):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [_PACKAGE_ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    child = subprocess.Popen([sys.executable, "-c", "from overflow_fast.report.diff_parts import child; child()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    _send(child, (path_a, path_b, options))
    return child


# the messages between the processes: a length (8 bytes), then that many bytes of pickle
def _write_message(stream, value):
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_message(stream):
    """The next message, or None at the end of the stream (or a message cut short)."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    size = struct.unpack("<Q", head)[0]
    data = stream.read(size)
    return pickle.loads(data) if len(data) == size else None  # this process's own child or parent wrote it


def _send(child, value):
    try:
        _write_message(child.stdin, value)
    except OSError:  # it died: its result says so
        pass


def _result(child):
    try:
        message = _read_message(child.stdout)
    except Exception:
        message = None
    if message is None:
        child.wait()
        raise PartFailed(f"a part ended without a result, exit code {child.returncode}")
    status, value = message
    if status == "ok":
        return value
    if status == "out of range":
        raise OutOfRange(value)
    if status == "bad file":
        raise BadFile(value)
    raise PartFailed(f"a part failed: {value}")


def child():
    """Parts, in a child process: the logs and options, then each part's cut, on stdin; each
    part's Diff on stdout, in turn, until stdin ends."""
    path_a, path_b, options = _read_message(sys.stdin.buffer)
    while True:
        cut = _read_message(sys.stdin.buffer)
        if cut is None:
            return
        try:
            result = ("ok", part(path_a, path_b, options, cut))
        except OutOfRange as error:
            result = ("out of range", str(error))
        except BadFile as error:
            result = ("bad file", str(error))
        except Exception as error:
            result = ("error", f"{type(error).__name__}: {error}")
        _write_message(sys.stdout.buffer, result)


def part(path_a, path_b, options, cut):
    """The diff of one part: ``cut`` is (start and end in A, start and end in B, first step, end
    step); the end of the last part is None (the file's end)."""
    a_start, a_end, b_start, b_end, first, end = cut
    diff = Diff(**options)
    diff.run(EntryReader(path_a, a_start, a_end), EntryReader(path_b, b_start, b_end), steps=(first, end))
    return diff


def plan(path_a, path_b, count, min_part_bytes=MIN_PART_BYTES):
    """The parts of a diff of two plain logs, at most ``count``: [(start and end in A, start and
    end in B, first step, end step)], or None for one pass (a stream, a compressed log, a small
    one, a log whose steps give no cut)."""
    sizes = []
    for path in (path_a, path_b):
        if not _plain(path):
            return None
        sizes.append(os.path.getsize(path))
    count = min(count, sum(sizes) // max(min_part_bytes, 1))
    if count < 2:
        return None
    steps = []
    for k in range(1, count):
        found = entry_at(path_a, k * sizes[0] // count)
        if found is not None and found[1] > (steps[-1] if steps else 0):
            steps.append(found[1])
    if not steps:
        return None
    cuts_a = [0] + [first_of_step(path_a, step, sizes[0]) for step in steps] + [None]
    cuts_b = [0] + [first_of_step(path_b, step, sizes[1]) for step in steps] + [None]
    bounds = [0] + steps + [schema.STEP_MAX + 1]
    return [(cuts_a[k], cuts_a[k + 1], cuts_b[k], cuts_b[k + 1], bounds[k], bounds[k + 1])
            for k in range(len(steps) + 1)]


def _plain(path):
    """A regular file, not compressed."""
    try:
        if not os.path.isfile(path):
            return False
        with LogFile(path) as handle:
            return handle.compression is None
    except Exception:
        return False


def first_of_step(path, step, size):
    """The byte offset where the first entry line of ``step`` or later starts (``size`` when
    none does), by bisection: the log in step order."""
    low, high = 0, size
    while low < high:
        middle = (low + high) // 2
        found = entry_at(path, middle)
        if found is None or found[1] >= step:
            high = middle
        else:
            low = found[2]
    found = entry_at(path, low)
    return size if found is None else found[0]


