"""``overflow-fast diff`` on large plain logs, in parts: their steps cut into ranges of about the
same size, each range compared in a process of its own (the same ``Diff`` on the lines of those
steps), the parts merged in order. It gives the very diff that one pass gives.

A cut is a step: in each log, the part ends where the first entry of that step begins (found by
bisection over byte offsets, as the logs are in step order). A part that meets a record outside
its steps (logs not in step order there: several ranks' records interleaved, say) stops, and the
logs are compared whole, in one pass. Compressed logs, streams and small logs are compared in one
pass.
"""

import os
import pickle
import subprocess
import sys

from ..recording import schema
from .diff import Diff, OutOfRange
from .entries import EntryReader, entry_at
from .summary import BadFile, LogFile

MIN_PART_BYTES = 32 << 20  # below this a part costs more to start than it saves
MAX_JOBS = 8


def default_jobs():
    try:
        return max(1, min(len(os.sched_getaffinity(0)), MAX_JOBS))
    except AttributeError:  # no affinity here
        return max(1, min(os.cpu_count() or 1, MAX_JOBS))


def diff_logs(path_a, path_b, options, jobs=None, min_part_bytes=MIN_PART_BYTES):
    """The finished ``Diff(**options)`` of two logs: in parts when they are plain files big
    enough for more than one (at most ``jobs`` parts: default one per CPU, at most 8)."""
    jobs = default_jobs() if jobs is None else jobs
    parts = plan(path_a, path_b, jobs, min_part_bytes) if jobs > 1 else None
    failed = None
    if parts is not None:
        try:
            diff = _in_parts(path_a, path_b, options, parts)
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


def _in_parts(path_a, path_b, options, parts):
    """Each part but the first in a child process, the first here; merged in order."""
    children = []
    try:
        for cut in parts[1:]:
            children.append(_start(path_a, path_b, options, cut))
        diff = part(path_a, path_b, options, parts[0])
        for child in children:
            diff.merge(_result(child))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdout.close()
    return diff


# a child is this Python, importing this package from where this process found it (not a fork: a
# fork of a process with threads may hang; not multiprocessing's spawn, which runs the caller's
# script again in the child when it lacks a __main__ guard)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(path_a, path_b, options, cut):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [_PACKAGE_ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    child = subprocess.Popen([sys.executable, "-c", "from overflow_fast.report.diff_parts import child; child()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    with child.stdin:
        child.stdin.write(pickle.dumps((path_a, path_b, options, cut)))
    return child


def _result(child):
    data = child.stdout.read()
    child.wait()
    try:
        status, value = pickle.loads(data)  # this process's own child wrote it
    except Exception:
        raise PartFailed(f"a part ended without a result, exit code {child.returncode}") from None
    if status == "ok":
        return value
    if status == "out of range":
        raise OutOfRange(value)
    if status == "bad file":
        raise BadFile(value)
    raise PartFailed(f"a part failed: {value}")


def child():
    """A part, in a child process: its arguments pickled on stdin, its Diff pickled on stdout."""
    path_a, path_b, options, cut = pickle.load(sys.stdin.buffer)
    try:
        result = ("ok", part(path_a, path_b, options, cut))
    except OutOfRange as error:
        result = ("out of range", str(error))
    except BadFile as error:
        result = ("bad file", str(error))
    except Exception as error:
        result = ("error", f"{type(error).__name__}: {error}")
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()


def part(path_a, path_b, options, cut):
    """The diff of one part: ``cut`` is (start and end in A, start and end in B, first step, end
    step); the end of the last part is None (the file's end)."""
    a_start, a_end, b_start, b_end, first, end = cut
    diff = Diff(**options)
    diff.run(EntryReader(path_a, a_start, a_end), EntryReader(path_b, b_start, b_end), steps=(first, end))
    return diff


def plan(path_a, path_b, jobs, min_part_bytes=MIN_PART_BYTES):
    """The parts of a diff of two plain logs: [(start and end in A, start and end in B, first
    step, end step)], or None for one pass (a stream, a compressed log, a small one, a log whose
    steps give no cut)."""
    sizes = []
    for path in (path_a, path_b):
        if not _plain(path):
            return None
        sizes.append(os.path.getsize(path))
    count = min(jobs, sum(sizes) // max(min_part_bytes, 1))
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


