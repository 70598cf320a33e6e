"""The JSONL flight recorder: strict JSON, off-thread writes, complete lines after flush, close,
exit, SIGTERM and SIGKILL, one file per rank, write errors that never crash."""

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from overflow_fast.recording import recorder as rec_mod
from overflow_fast.hooks.frames import Frame, entries_of, forward_items
from overflow_fast.recording.recorder import Recorder, decode_float, entry_record, frame_records, rank_path
from overflow_fast.stats import tensor_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reject(constant):
    raise ValueError(f"non-strict JSON constant {constant}")


def strict_lines(path):
    """Every line of the file parsed by a strict parser; the file must end with a newline."""
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"" or data.endswith(b"\n"), "partial last line"
    return [json.loads(line, parse_constant=_reject) for line in data.decode("utf-8").splitlines()]


def _rows(tensors):
    return tensor_stats(tensors, backend="torch").values.tolist()


def child_env():
    """The environment of a child whose output must really be buffered (PYTHONUNBUFFERED unset)."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- records ---------------------------------------------------------------------------------------

def test_every_line_is_strict_json(tmp_path):
    nan, inf = float("nan"), float("inf")
    tensors = [
        torch.tensor([1.0, nan, 2.0], dtype=torch.float16),
        torch.tensor([inf, -inf, 3.0]),
        torch.tensor([-inf, 1.0], dtype=torch.bfloat16),
        torch.empty(0, dtype=torch.float16),
        torch.tensor([-128, 5], dtype=torch.int8),
        torch.tensor([-(2**63), 1], dtype=torch.int64),
        torch.tensor([True, False, False]),
        torch.tensor([1e-40, 0.0, 0.0, 1.0]),
        torch.tensor([3 + 4j, 0j], dtype=torch.complex64),
    ]
    rows = _rows(tensors)
    # a uint64 magnitude of 2**64 - 1 (all bits set), as the kernels store it
    rows.append([-1, -1, 0, 0, 0, 0, 0, 2])
    dtypes = [t.dtype for t in tensors] + [torch.uint64]
    path = tmp_path / "run.jsonl"
    with Recorder(path) as recorder:
        recorder.write([entry_record(7, "forward", i, "h.0.mlp", "MLP", f"input[{i}]", dtype, row, rank=None)
                        for i, (dtype, row) in enumerate(zip(dtypes, rows))])
        recorder.write([{"record": "detection", "odd": [float("nan"), float("-inf")], "dtype": torch.float16}])
    lines = strict_lines(path)
    meta, entries, detection = lines[0], lines[1:-1], lines[-1]
    assert meta["record"] == "meta" and meta["version"] == 1 and meta["pid"] == os.getpid()
    assert meta["torch"] == torch.__version__ and meta["started"].endswith("+00:00")
    assert set(meta) == {"record", "version", "rank", "world_size", "started", "pid", "torch", "check"}
    assert meta["check"] is None  # a Recorder of its own; a detector names its mode
    assert len(entries) == len(dtypes)
    keys = ["record", "step", "phase", "call", "module", "class", "entry", "dtype", "numel", "abs_min", "abs_max",
            "nan", "posinf", "neginf", "zero_frac", "subnormal_frac", "rank"]
    assert all(list(e) == keys for e in entries)
    e = entries
    assert e[0]["dtype"] == "float16" and e[0]["abs_max"] == "nan" and e[0]["nan"] == 1
    assert e[1]["abs_max"] == "inf" and e[1]["abs_min"] == 3.0 and (e[1]["posinf"], e[1]["neginf"]) == (1, 1)
    assert e[2]["abs_max"] == "inf" and e[2]["neginf"] == 1 and e[2]["dtype"] == "bfloat16"
    assert e[3]["numel"] == 0 and e[3]["abs_min"] is None and e[3]["abs_max"] is None
    assert e[3]["zero_frac"] == 0.0 and e[3]["subnormal_frac"] == 0.0
    assert e[4]["abs_max"] == 128 and isinstance(e[4]["abs_max"], int) and e[4]["abs_min"] == 5
    assert e[5]["abs_max"] == 2**63 and e[5]["abs_min"] == 1
    assert e[6]["abs_max"] == 1.0 and isinstance(e[6]["abs_max"], float) and e[6]["zero_frac"] == pytest.approx(2 / 3)
    assert e[7]["subnormal_frac"] == 0.25 and e[7]["zero_frac"] == 0.5
    assert e[8]["abs_max"] == 5.0 and e[8]["dtype"] == "complex64"
    assert e[9]["abs_max"] == 2**64 - 1 and e[9]["dtype"] == "uint64"
    assert all(x["step"] == 7 and x["phase"] == "forward" and x["module"] == "h.0.mlp" and x["class"] == "MLP"
               for x in e)
    assert [x["call"] for x in e] == list(range(len(dtypes)))
    assert detection["odd"] == ["nan", "-inf"] and detection["dtype"] == "float16"
    assert decode_float("nan") != decode_float("nan") and decode_float("-inf") == float("-inf")


def test_frame_records_cover_the_tensor_entries_of_a_frame():
    linear = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    entries, tensors, dtypes = entries_of(forward_items(linear, (x, None), linear(x)))
    frame = Frame("fc", "Linear", entries, dtypes)
    frame.rows = _rows(tensors)
    records = frame_records(3, "forward", 5, frame, rank=2)
    assert [r["entry"] for r in records] == ["weight", "bias", "input[0]", "output"]  # None has no record
    assert all(r["call"] == 5 and r["rank"] == 2 and r["class"] == "Linear" for r in records)
    assert records[-1]["numel"] == 2


def test_global_step_and_mode_are_written_when_known_and_left_out_when_not():
    from overflow_fast.recording import schema
    from overflow_fast.recording.recorder import detection_record, encode_line

    linear = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    entries, tensors, dtypes = entries_of(forward_items(linear, (x,), linear(x)))
    frame = Frame("fc", "Linear", entries, dtypes)
    frame.rows = _rows(tensors)
    old = frame_records(8, "forward", 0, frame, None)  # the positional signature as before
    new = frame_records(8, "forward", 0, frame, None, global_step=3, mode="eval")
    assert all("global_step" not in r and "mode" not in r for r in old)
    assert all(r["global_step"] == 3 and r["mode"] == "eval" and r["step"] == 8 for r in new)
    assert list(new[0]) == [k for k in schema.KEYS["entry"] if k != "computed_in"]  # the schema's order, the new fields last
    frame.computed_in = torch.float16  # under autocast
    assert [r["computed_in"] for r in frame_records(8, "forward", 0, frame, None)] == ["float16"] * len(new)
    frame.computed_in = None
    assert list(old[0]) == [k for k in schema.KEYS["entry"] if k not in schema.WHEN_KNOWN]
    train = entry_record(8, "forward", 0, "fc", "Linear", "weight", "float32", frame.rows[0], 1, 2 ** 40, "train")
    assert (train["rank"], train["global_step"], train["mode"]) == (1, 2 ** 40, "train")
    only_mode = detection_record(8, "forward", "fc", "Linear", ["output"], None, mode="eval")
    assert "global_step" not in only_mode and only_mode["mode"] == "eval"
    detection = detection_record(8, "backward", "fc", "Linear", ["weight.grad"], 0, 3, "train")
    assert list(detection) == [k for k in schema.KEYS["detection"] if k != "where"]  # where: the detector adds it
    for record in old + new + [train, only_mode, detection]:
        assert schema.check(json.loads(encode_line(record))) == record["record"]
    with pytest.raises(schema.Malformed, match="mode"):
        schema.check(dict(new[0], mode="training"))
    with pytest.raises(schema.Malformed, match="global_step"):
        schema.check(dict(new[0], global_step=2 ** 40 + 1))


def test_log_every_must_be_positive():
    with pytest.raises(ValueError):
        Recorder(os.devnull, log_every=0)


def test_should_record(tmp_path):
    with Recorder(tmp_path / "a.jsonl", log_every=100) as recorder:
        assert [s for s in range(350) if recorder.should_record(s)] == [0, 100, 200, 300]


# -- threading and durability -------------------------------------------------------------------------

class _WaitsForTheWriter:
    """Encoded through ``item()`` (as numpy scalars are). ``item()`` waits until the writing
    thread's ``write()`` has returned: if ``write()`` encoded on the calling thread, the wait could
    only end by its timeout, and the record says so. No clock is read."""

    returned = threading.Event()
    seen = []  # (thread that encoded, whether write() had returned by then)

    def item(self):
        _WaitsForTheWriter.seen.append((threading.current_thread(), _WaitsForTheWriter.returned.wait(10)))
        return 1.5


def test_write_returns_at_once_and_encodes_off_the_calling_thread(tmp_path):
    path = tmp_path / "slow.jsonl"
    _WaitsForTheWriter.seen.clear()
    _WaitsForTheWriter.returned.clear()
    recorder = Recorder(path)
    recorder.write([{"record": "entry", "value": _WaitsForTheWriter()}])
    _WaitsForTheWriter.returned.set()
    recorder.flush()
    assert len(_WaitsForTheWriter.seen) == 1
    thread, write_had_returned = _WaitsForTheWriter.seen[0]
    assert thread is not threading.current_thread() and write_had_returned
    assert strict_lines(path)[-1] == {"record": "entry", "value": 1.5}
    recorder.close()


def test_complete_after_flush_and_close(tmp_path):
    path = tmp_path / "run.jsonl"
    recorder = Recorder(path)
    for step in range(50):
        recorder.write([{"record": "entry", "step": step, "i": i} for i in range(20)])
    recorder.flush()
    assert len(strict_lines(path)) == 1 + 50 * 20
    recorder.write([{"record": "entry", "step": 50}])
    recorder.close()
    lines = strict_lines(path)
    assert len(lines) == 1 + 50 * 20 + 1 and lines[-1]["step"] == 50
    recorder.close()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder.write([{"record": "entry"}])  # after close: warned and dropped, never raised
        recorder.write([{"record": "entry"}])
    assert len([w for w in caught if "closed" in str(w.message)]) == 1
    assert len(strict_lines(path)) == 1 + 50 * 20 + 1


def test_write_error_warns_once_and_never_raises():
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = Recorder("/dev/full")
        for step in range(5):
            recorder.write([{"record": "entry", "step": step}])
            recorder.flush()
        recorder.close()
    messages = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(messages) == 1 and "/dev/full" in messages[0]


def test_a_full_disk_warns_once_and_drops():
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (every write fails with ENOSPC)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = Recorder("/dev/full")
        for _ in range(2):
            recorder.write([{"record": "entry"}])
            recorder.flush()
        recorder.close()
    failures = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(failures) == 1 and "No space left on device" in failures[0], failures


_CHILD = """
import os, sys, time, signal
from overflow_fast.recording import recorder as R
{setup}
rec = R.Recorder(sys.argv[1])
for step in range({steps}):
    rec.write([{{"record": "entry", "step": step, "i": i, "pad": "x" * 40}} for i in range(10)])
{after}
"""


def _run_child(tmp_path, steps, setup="", after="", **kwargs):
    script = textwrap.dedent(_CHILD.format(steps=steps, setup=setup, after=after))
    path = tmp_path / "child.jsonl"
    return path, subprocess.Popen([sys.executable, "-c", script, str(path)], env=child_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_complete_after_normal_exit_of_a_child(tmp_path):
    # the writer is slowed down so records are still queued when the script ends
    setup = "_enc = R.encode_line\nR.encode_line = lambda r: (time.sleep(0.001), _enc(r))[1]"
    path, child = _run_child(tmp_path, 100, setup=setup, after="sys.stdout.write('done\\n')")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    lines = strict_lines(path)
    assert len(lines) == 1 + 100 * 10
    assert [l["step"] for l in lines[1::10]] == list(range(100))


def test_complete_after_sigterm_of_a_child(tmp_path):
    # a slow writer: most records are still queued when SIGTERM arrives
    setup = "_enc = R.encode_line\nR.encode_line = lambda r: (time.sleep(0.002), _enc(r))[1]"
    after = "print('ready', flush=True)\ntime.sleep(60)"
    path, child = _run_child(tmp_path, 100, setup=setup, after=after)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=120)
    assert child.returncode == -signal.SIGTERM  # still dies of SIGTERM (the default handler's behaviour)
    lines = strict_lines(path)
    assert len(lines) == 1 + 100 * 10


def test_sigterm_chains_to_the_previous_handler(tmp_path):
    setup = ("def previous(signum, frame):\n    os.write(1, b'previous handler\\n')\n    sys.exit(7)\n"
             "signal.signal(signal.SIGTERM, previous)")
    after = "print('ready', flush=True)\ntime.sleep(60)"
    path, child = _run_child(tmp_path, 30, setup=setup, after=after)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 7 and "previous handler" in out, err
    assert len(strict_lines(path)) == 1 + 30 * 10


def test_sigkill_leaves_only_complete_lines(tmp_path):
    after = textwrap.dedent("""
    rec.flush()
    print("flushed", 20 * 10 + 1, flush=True)
    step = 20
    while True:
        rec.write([{"record": "entry", "step": step, "i": i, "pad": "y" * 200} for i in range(50)])
        step += 1
    """)
    path, child = _run_child(tmp_path, 20, after=after)
    line = child.stdout.readline().split()
    assert line[0] == "flushed"
    time.sleep(0.3)  # the writer is busy writing when the kill comes
    child.kill()
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    lines = strict_lines(path)  # no partial line, whatever the moment of the kill
    assert len(lines) >= int(line[1])
    assert lines[0]["record"] == "meta"


# -- one file per rank ------------------------------------------------------------------------------

def test_rank_paths(tmp_path, monkeypatch):
    assert rank_path("run.jsonl") == "run.jsonl"
    assert rank_path("run.jsonl", 1, 1) == "run.jsonl"
    assert rank_path("logs/run.jsonl", 1, 4) == os.path.join("logs", "run.rank1.jsonl")
    assert rank_path("logs/run", 3, 4) == os.path.join("logs", "run.rank3")
    assert rank_path("run-{rank}.jsonl", 2, 4) == "run-2.jsonl"
    assert rank_path("run-{rank}.jsonl") == "run-0.jsonl"

    with Recorder(tmp_path / "r.jsonl", rank=1, world_size=2) as recorder:
        assert recorder.path == str(tmp_path / "r.rank1.jsonl")
    meta = strict_lines(tmp_path / "r.rank1.jsonl")[0]
    assert (meta["rank"], meta["world_size"]) == (1, 2)

    # under a launcher before init_process_group: RANK / WORLD_SIZE from the environment
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with Recorder(tmp_path / "e.jsonl") as recorder:
        recorder.write([entry_record(0, "backward", 0, "", "GPT2", "weight.grad", torch.float32,
                                     _rows([torch.ones(2)])[0], rank=recorder.rank)])
    lines = strict_lines(tmp_path / "e.rank3.jsonl")
    assert lines[0]["rank"] == 3 and lines[1]["rank"] == 3 and lines[1]["phase"] == "backward"
    assert not (tmp_path / "e.jsonl").exists()


def test_records_are_not_written_twice_by_a_forked_child(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    path = tmp_path / "fork.jsonl"
    recorder = Recorder(path)
    recorder.write([{"record": "entry", "step": 0}])
    recorder.flush()
    pid = os.fork()
    if pid == 0:  # the child writes nothing and flushes nothing of the parent's
        try:
            recorder.write([{"record": "entry", "step": 99}])
            recorder.flush()
            rec_mod._close_all_at_exit()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    recorder.close()
    assert [l.get("step") for l in strict_lines(path)] == [None, 0]


def test_a_stalled_writer_drops_beyond_max_pending(tmp_path):
    path = tmp_path / "full.jsonl"
    recorder = Recorder(path, max_pending=100)
    with recorder._io_lock:  # the writer is stuck (a stalled disk)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(30):
                recorder.write([{"record": "entry", "step": step, "i": i} for i in range(10)])
        assert len([w for w in caught if "waiting for a slow disk" in str(w.message)]) == 1
    recorder.close()
    lines = strict_lines(path)
    assert 1 + 90 <= len(lines) <= 1 + 100 and lines[-1]["step"] < 10


# -- one writer per file ------------------------------------------------------------------------------

def test_a_second_recorder_on_the_same_file_is_refused_in_this_process(tmp_path):
    path = tmp_path / "run.jsonl"
    first = Recorder(path)
    first.write([{"record": "entry", "step": 0}])
    first.flush()
    with pytest.raises(rec_mod.LogInUse, match=str(path)):
        Recorder(path)
    with pytest.raises(rec_mod.LogInUse):  # the same file under another name
        Recorder(tmp_path / "." / "run.jsonl")
    first.write([{"record": "entry", "step": 1}])
    first.close()
    # the refused one cut nothing: the first writer's lines are all there
    assert [line.get("step") for line in strict_lines(path)] == [None, 0, 1]
    with Recorder(path) as again:  # released on close
        again.write([{"record": "entry", "step": 2}])
    assert [line.get("step") for line in strict_lines(path)] == [None, 2]


def test_two_detectors_with_one_log_path(tmp_path):
    from overflow_fast import DebugUnderflowOverflow

    path = tmp_path / "run.jsonl"
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    detector = DebugUnderflowOverflow(a, log=str(path))
    try:
        with pytest.raises(rec_mod.LogInUse, match="already being written"):
            DebugUnderflowOverflow(b, log=str(path))
        assert not b._forward_hooks  # refused before any hook went on
        a(torch.ones(1, 2))
    finally:
        detector.remove()


_HOLDER = """
import sys, time
from overflow_fast.recording.recorder import Recorder
recorder = Recorder(sys.argv[1])
recorder.write([{"record": "entry", "step": 0}])
recorder.flush()
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_second_recorder_on_the_same_file_is_refused_in_another_process(tmp_path):
    path = tmp_path / "run.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], env=child_env(), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "holding"
        with pytest.raises(rec_mod.LogInUse, match=str(path)):
            Recorder(path)
        assert [line.get("step") for line in strict_lines(path)] == [None, 0]
    finally:
        child.kill()  # dies without closing: the lock goes with the process
        child.communicate(timeout=60)
    with Recorder(path) as recorder:
        recorder.write([{"record": "entry", "step": 5}])
    assert [line.get("step") for line in strict_lines(path)] == [None, 5]


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    path = tmp_path / "run.jsonl"
    recorder = Recorder(path)
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker that outlives the parent's recorder
        try:
            os.close(write)
            os.write(ready_write, b"r")  # running: its at-fork hook has dropped its copy of the file
            os.read(read, 1)
        finally:
            os._exit(0)
    os.close(read)
    try:
        assert os.read(ready_read, 1) == b"r"
        recorder.close()
        Recorder(path).close()  # not refused while the child still runs
    finally:
        os.close(write)
        os.waitpid(pid, 0)
        os.close(ready_read)
        os.close(ready_write)


# -- streams: FIFOs, pipes, terminals, this process's own stdout ----------------------------------------

def _construct_in_a_thread(make):
    """Run ``make()`` on a thread; (finished, its result or the exception it raised). A constructor
    that blocks is not waited for forever: the test fails instead of hanging."""
    outcome = []

    def target():
        try:
            outcome.append(make())
        except BaseException as error:  # noqa: B902 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=60)
    return not thread.is_alive(), outcome[0] if outcome else None


def _unblock_writer(fifo):
    """Give a writer stuck opening ``fifo`` its reader, so a failed test leaves no thread behind."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.close(fd)


def _needs_fifo():
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")


@pytest.mark.parametrize("via", ["recorder", "detector"])
def test_a_fifo_without_a_reader_is_refused_at_once(tmp_path, via):
    _needs_fifo()
    from overflow_fast import DebugUnderflowOverflow

    fifo = str(tmp_path / "run.fifo")
    os.mkfifo(fifo)
    model = torch.nn.Linear(2, 2)
    make = (lambda: Recorder(fifo)) if via == "recorder" else (lambda: DebugUnderflowOverflow(model, log=fifo))
    finished, result = _construct_in_a_thread(make)
    if not finished:
        _unblock_writer(fifo)
    assert finished, "the constructor blocked on a FIFO without a reader"
    assert isinstance(result, OSError), result
    assert fifo in str(result) and "no process is reading" in str(result)
    assert not model._forward_hooks  # refused before any hook went on


def _fionread(fd):
    import array
    import fcntl
    import termios

    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def _shrink_pipe(fd):
    """Make the pipe of ``fd`` as small as it can be (a page, on Linux): a writer of much more than
    that must then wait for room, again and again, whenever its reader is not reading."""
    import fcntl

    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    except OSError:
        pass


def _wait_until(condition, what):
    for _ in range(6000):  # a bounded wait (about a minute): never a hang
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _read_lines(fd, count):
    """The first ``count`` lines from ``fd``, parsed; waits a bounded time for each (never a hang)."""
    import select

    data = b""
    while data.count(b"\n") < count:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, f"no more data after {data!r}"
        block = os.read(fd, 1 << 16)
        assert block, f"end of stream after {data!r}"
        data += block
    return [json.loads(line, parse_constant=_reject) for line in data.splitlines()[:count]]


def _read_all(fd, into):
    while True:
        block = os.read(fd, 1 << 16)
        if not block:
            return
        into.append(block)


def test_a_fifo_with_a_reader_gets_every_record_even_when_the_pipe_is_full(tmp_path):
    _needs_fifo()
    fifo = str(tmp_path / "run.fifo")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that has not started reading yet
    _shrink_pipe(reader)
    try:
        finished, recorder = _construct_in_a_thread(lambda: Recorder(fifo, rank=1, world_size=2))
        assert finished and isinstance(recorder, Recorder), recorder
        assert recorder.path == fifo  # no rank suffix: a stream is shared by the ranks
        assert not os.path.exists(fifo + ".rank1") and not os.path.exists(str(tmp_path / "run.rank1.fifo"))
        os.set_blocking(reader, True)
        big = "z" * 3 * select.PIPE_BUF  # a line longer than PIPE_BUF
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(200):
                recorder.write([{"record": "entry", "step": step, "i": i, "pad": "x" * 80} for i in range(50)])
            recorder.write([{"record": "entry", "step": 200, "pad": big}])
            # the writer has begun: with a page of pipe for a megabyte, it must wait for room (were its
            # writes non-blocking, they would fail and records would be dropped)
            _wait_until(lambda: _fionread(reader) > 0, "the first records in the pipe")
            blocks = []
            drain = threading.Thread(target=_read_all, args=(reader, blocks), daemon=True)
            drain.start()
            recorder.close()
            drain.join(timeout=60)
            assert not drain.is_alive()
        assert not [w for w in caught if "overflow_fast" in str(w.message)]
    finally:
        os.close(reader)
    data = b"".join(blocks)
    assert data.endswith(b"\n")
    lines = [json.loads(line, parse_constant=_reject) for line in data.decode().splitlines()]
    assert lines[0]["record"] == "meta" and len(lines) == 1 + 200 * 50 + 1
    assert [(l["step"], l["i"]) for l in lines[1:-1]] == [(s, i) for s in range(200) for i in range(50)]
    assert lines[-1]["pad"] == big


def test_two_recorders_share_a_fifo_and_a_reader_that_leaves_is_warned_about(tmp_path):
    _needs_fifo()
    fifo = str(tmp_path / "shared.fifo")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(reader, True)
    first, second = Recorder(fifo), Recorder(fifo)  # no LogInUse: a stream is shared by design
    first.write([{"record": "entry", "who": "first"}])
    second.write([{"record": "entry", "who": "second"}])
    first.flush()
    second.flush()
    got = _read_lines(reader, 4)
    os.close(reader)
    assert sorted(l.get("who", "meta") for l in got) == ["first", "meta", "meta", "second"]
    # the reader is gone: writing warns once and drops, it never raises into training
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            first.write([{"record": "entry", "step": step}])
            first.flush()
        first.close()
        second.close()
    messages = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(messages) == 1 and fifo in messages[0]


def test_a_terminal_gets_every_record(tmp_path):
    if not hasattr(os, "openpty"):
        pytest.skip("needs a pseudo-terminal")
    master, slave = os.openpty()
    name = os.ttyname(slave)
    blocks = []

    def read_terminal():
        while True:
            try:
                block = os.read(master, 1 << 16)
            except OSError:  # EIO: the terminal's last writer closed it
                return
            if not block:
                return
            blocks.append(block)
            if b"".join(blocks).count(b"\n") >= 1 + 100:
                return

    drain = threading.Thread(target=read_terminal, daemon=True)
    drain.start()
    try:
        with Recorder(name) as recorder:  # a terminal cannot seek
            for step in range(100):
                recorder.write([{"record": "entry", "step": step}])
        drain.join(timeout=60)
        assert not drain.is_alive()
    finally:
        os.close(slave)
        os.close(master)
    lines = [json.loads(line) for line in b"".join(blocks).decode().splitlines()]
    assert lines[0]["record"] == "meta" and [l["step"] for l in lines[1:]] == list(range(100))


def test_sigterm_kills_a_process_whose_fifo_reader_stopped_reading(tmp_path):
    _needs_fifo()
    fifo = str(tmp_path / "stalled.fifo")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read: the pipe fills and stays full
    script = textwrap.dedent("""
    import sys, time
    from overflow_fast.recording import recorder as R
    R.STALL_SECONDS = 0.5
    rec = R.Recorder(sys.argv[1])
    for step in range(200):
        rec.write([{"record": "entry", "step": step, "i": i, "pad": "x" * 200} for i in range(50)])
    print("ready", flush=True)
    time.sleep(120)
    """)
    child = subprocess.Popen([sys.executable, "-c", script, fifo], env=child_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "ready"
        _wait_until(lambda: _fionread(reader) > 0, "the first records in the pipe")
        child.send_signal(signal.SIGTERM)
        try:
            _, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM did not end a process whose log is not being read") from None
    finally:
        child.kill()
        child.communicate()
        os.close(reader)
    assert child.returncode == -signal.SIGTERM
    assert "is not being read: records still queued are dropped" in err  # said, never silent


_STDOUT_CHILD = """
import os, sys, threading
from overflow_fast.recording.recorder import Recorder
{setup}
recorder = Recorder("/dev/stdout")
twin = Recorder("/dev/stdout")  # a second writer of the same stream is no LogInUse
for step in range({steps}):
    recorder.write([{{"record": "entry", "step": step, "i": i, "pad": "x" * 60}} for i in range(20)])
twin.write([{{"record": "entry", "step": -1}}])
{after}
recorder.close()
twin.close()
"""


def _stdout_child(steps=50, setup="", after="", **kwargs):
    script = textwrap.dedent(_STDOUT_CHILD.format(steps=steps, setup=setup, after=after))
    return subprocess.Popen([sys.executable, "-c", script], env=child_env(), **kwargs)


def _records_and_prints(data):
    """The lines of a stream that mixes the child's own prints and records: every line one or the other."""
    records, prints = [], []
    for line in data.decode().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line, parse_constant=_reject))
        else:
            prints.append(line)
    return records, prints


def _check_child_records(records, steps=50):
    assert [r["record"] for r in records].count("meta") == 2
    entries = [(r["step"], r["i"]) for r in records if r["record"] == "entry" and r["step"] >= 0]
    assert entries == [(s, i) for s in range(steps) for i in range(20)]
    assert [r for r in records if r.get("step") == -1]


def test_dev_stdout_as_a_pipe_gets_every_record_and_lines_stay_whole():
    # another thread prints small lines all the while: records must never be cut by them
    setup = textwrap.dedent("""
    def noise():
        for n in range(2000):
            os.write(1, b"noise %d\\n" % n)
    thread = threading.Thread(target=noise)
    thread.start()
    """)
    child = _stdout_child(setup=setup, after="thread.join()", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err.decode()
    records, prints = _records_and_prints(out)
    _check_child_records(records)
    assert sorted(prints, key=lambda p: int(p.split()[1])) == [f"noise {n}" for n in range(2000)]


def test_dev_stdout_as_a_full_non_blocking_pipe_waits_and_drops_nothing():
    # the child's stdout is non-blocking (its owner made it so) and nobody reads it for a while
    setup = textwrap.dedent("""
    import array, fcntl, termios, time
    os.set_blocking(1, False)
    fcntl.fcntl(1, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)  # a page of pipe for a megabyte of records
    """)
    after = textwrap.dedent("""
    count = array.array("i", [0])
    for _ in range(6000):
        fcntl.ioctl(1, termios.FIONREAD, count)
        if count[0]:
            break
        time.sleep(0.01)
    sys.stderr.write("full %d\\n" % count[0])
    sys.stderr.flush()
    """)
    child = _stdout_child(steps=400, setup=setup, after=after,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stderr.readline().startswith(b"full ")  # the pipe is full: the writer had to wait
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err.decode()
    records, prints = _records_and_prints(out)
    assert prints == []
    _check_child_records(records, steps=400)


def test_dev_stdout_redirected_to_a_file_is_appended_to_not_truncated(tmp_path):
    path = tmp_path / "stdout.txt"
    with open(path, "wb") as out:
        child = _stdout_child(setup="print('before', flush=True)", after="print('after', flush=True)",
                              stdout=out, stderr=subprocess.PIPE)
        _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err.decode()
    data = path.read_bytes()
    records, prints = _records_and_prints(data)
    assert prints == ["before", "after"]
    assert data.startswith(b"before\n") and data.endswith(b"\n")  # nothing cut, nothing overwritten
    _check_child_records(records)


def test_dev_stdout_as_a_socket_gets_every_record():
    import socket

    ours, theirs = socket.socketpair()
    ours.settimeout(120)  # a child that hangs fails the test instead of hanging it
    try:
        child = _stdout_child(stdout=theirs.fileno(), stderr=subprocess.PIPE)
        theirs.close()
        blocks = []
        while True:
            block = ours.recv(1 << 16)
            if not block:
                break
            blocks.append(block)
        _, err = child.communicate(timeout=120)
    finally:
        ours.close()
    assert child.returncode == 0, err.decode()
    records, prints = _records_and_prints(b"".join(blocks))
    assert prints == []
    _check_child_records(records)


def _closed_descriptor():
    """A descriptor number not open in this process (far above the ones in use, so that no other
    thread opens it meanwhile)."""
    for fd in range(900, 1000):
        try:
            os.fstat(fd)
        except OSError:
            return fd
    pytest.skip("no free descriptor number")


def test_a_closed_descriptor_by_name_is_a_clear_error():
    fd = _closed_descriptor()
    with pytest.raises(OSError, match=f"/dev/fd/{fd} names file descriptor {fd} of this process, which is not open"):
        Recorder(f"/dev/fd/{fd}")


def test_the_detectors_records_reach_a_piped_dev_stdout():
    script = textwrap.dedent("""
    import torch
    from overflow_fast import DebugUnderflowOverflow
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    detector = DebugUnderflowOverflow(model, log="/dev/stdout")
    for step in range(3):
        model(torch.ones(2, 3))
        print("step", step, flush=True)
    detector.remove()
    """)
    child = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()
    records, prints = _records_and_prints(child.stdout)
    assert prints == ["step 0", "step 1", "step 2"]
    assert records[0]["record"] == "meta"
    entries = [r for r in records if r["record"] == "entry"]
    assert sorted({r["step"] for r in entries}) == [0, 1, 2] and all(r["module"] in ("", "0", "1") for r in entries)


def test_the_detectors_records_reach_a_fifo_read_by_another_process(tmp_path):
    _needs_fifo()
    from overflow_fast import DebugUnderflowOverflow

    fifo, copy = str(tmp_path / "run.fifo"), tmp_path / "copy.jsonl"
    os.mkfifo(fifo)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    with open(copy, "wb") as out:
        reader = subprocess.Popen(["cat", fifo], stdout=out)
    try:
        for attempt in range(6000):  # until cat is inside its open of the FIFO (a bounded wait)
            try:
                detector = DebugUnderflowOverflow(model, log=fifo)
                break
            except OSError as error:
                assert "no process is reading" in str(error)
                time.sleep(0.01)
        else:
            raise AssertionError("cat never opened the FIFO")
        for _ in range(3):
            model(torch.ones(2, 3))
        detector.remove()  # closes its log
        reader.wait(timeout=60)  # the recorder closed its end: cat sees the end of the stream
    finally:
        reader.kill()
        reader.wait()
    lines = strict_lines(copy)
    assert lines[0]["record"] == "meta"
    assert sorted({l["step"] for l in lines[1:]}) == [0, 1, 2]


def test_streams_keep_their_name_under_ranks(tmp_path):
    assert rank_path("/dev/stdout", 1, 4) == "/dev/stdout"
    assert rank_path("/dev/fd/2", 3, 4) == "/dev/fd/2"
    assert rank_path(os.devnull, 1, 2) == os.devnull
    assert rank_path("/dev/stdout-{rank}", 1, 2) == "/dev/stdout-1"  # asked for by name
    assert rank_path(tmp_path / "run.jsonl", 1, 2) == str(tmp_path / "run.rank1.jsonl")  # not there yet: a file


def test_a_descriptor_of_a_regular_file_is_shared_appended_to_and_guarded(tmp_path):
    path = tmp_path / "out.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    link = tmp_path / "link"
    os.symlink(f"/proc/self/fd/{fd}", link)
    try:
        os.write(fd, b"before\n")
        first, twin = Recorder(f"/dev/fd/{fd}"), Recorder(link)  # both the process's own stream
        with pytest.raises(rec_mod.LogInUse, match=str(path)):  # by name, it would be truncated
            Recorder(path)
        first.write([{"record": "entry", "step": s} for s in range(100)])
        first.flush()
        os.write(fd, b"between\n")  # the process's own writes go on where the records end
        twin.write([{"record": "entry", "step": 100}])
        first.close()
        twin.close()
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data.startswith(b"before\n") and data.endswith(b"\nafter\n")
    lines = data.decode().splitlines()
    records = [json.loads(line, parse_constant=_reject) for line in lines if line.startswith("{")]
    assert [line for line in lines if not line.startswith("{")] == ["before", "between", "after"]
    assert [r["record"] for r in records].count("meta") == 2
    assert [r["step"] for r in records if r["record"] == "entry"] == list(range(101))
    # the other way round: a file a recorder writes by name is not shared through a descriptor
    with Recorder(path) as by_name:
        other = os.open(path, os.O_WRONLY)
        try:
            with pytest.raises(rec_mod.LogInUse):
                Recorder(f"/dev/fd/{other}")
        finally:
            os.close(other)
        by_name.write([{"record": "entry", "step": 0}])
    assert [r["record"] for r in strict_lines(path)] == ["meta", "entry"]


def test_a_descriptor_open_for_reading_only_is_refused(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"data\n")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=f"/dev/fd/{fd} names file descriptor {fd} of this process, "
                                          f"which is open for reading only"):
            Recorder(f"/dev/fd/{fd}")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"data\n"


def test_a_unix_socket_by_path_is_a_clear_error(tmp_path):
    import socket

    path = str(tmp_path / "log.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(1)
        with pytest.raises(OSError, match=f"{path} is a Unix socket, which cannot be opened as a file"):
            Recorder(path)
    finally:
        server.close()


def test_a_stream_is_written_in_whole_lines_of_at_most_pipe_buf():
    data = b"".join(b"x" * n + b"\n" for n in
                    [0, 5, rec_mod.PIPE_BUF - 1, 10, rec_mod.PIPE_BUF, 3 * rec_mod.PIPE_BUF, 7] + [100] * 200)
    pieces = list(rec_mod.whole_line_pieces(data, rec_mod.PIPE_BUF))
    assert b"".join(data[a:b] for a, b in pieces) == data
    for a, b in pieces:
        assert data[b - 1:b] == b"\n"
        assert b - a <= rec_mod.PIPE_BUF or data[a:b - 1].count(b"\n") == 0  # longer: one line of its own
    for (a, b), (c, d) in zip(pieces, pieces[1:]):  # as few writes as may be: the next line did not fit
        assert (b - a) + data.index(b"\n", c) + 1 - c > rec_mod.PIPE_BUF
